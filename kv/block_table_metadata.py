"""Per-step metadata for attention kernels that read K/V straight from the paged cache.

Unlike ``AttentionMetadata`` (padded gather indices for PyTorch), nothing here grows with the
context: a kernel walks each sequence's row of the block table itself. A sequence ``b`` of the
step owns rows ``query_start[b] .. query_start[b] + query_len[b]`` of the flat batch, whose
tokens sit at positions ``context_len[b] - query_len[b] ..`` and see the keys before them::

    seq b:  [ cached: context_len - query_len ][ this step: query_len ]
             slot of position p: block_table[b, p // block_size] * block_size + p % block_size

Decodes (one new token) and prefills (more) are listed apart, since they run different kernels.
A prefill with nothing cached and no window cut ("fresh") sees exactly its own new keys, so it may
also run as plain causal attention on the new K/V. Building costs O(T + the step's block ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from kv.attention_metadata import SeqSlice, first_key_position, flat_positions_and_slots
from kv.host_staging import tensor_on, to_device


@dataclass(frozen=True)
class BlockTableMetadata:
    """What a layer needs to write and read the paged KV cache for one step (one window)."""

    num_tokens: int
    block_size: int  # tokens per cache block
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    block_table: torch.Tensor  # [B, max_blocks] int32 block ids; padding 0, never read
    query_start: torch.Tensor  # [B] int32 row of each sequence's first new token
    query_len: torch.Tensor  # [B] int32
    context_len: torch.Tensor  # [B] int32 cached + new tokens
    decode_ids: torch.Tensor  # [Bd] int32 sequences with one new token
    prefill_ids: torch.Tensor  # [Bp] int32 sequences with more
    cached_prefill_ids: torch.Tensor  # [Bc] the prefills that are not fresh
    fresh_prefills: Tuple[Tuple[int, int], ...]  # (start, end) rows of the fresh prefills
    num_decodes: int
    max_decode_keys: int  # the most keys one decode sees (the window applied)
    max_query_len: int  # the longest prefill chunk
    sliding_window: Optional[int] = None  # None: full attention


def _is_fresh(seq: SeqSlice, sliding_window: Optional[int]) -> bool:
    return seq.num_computed == 0 and (sliding_window is None or seq.context_len <= sliding_window)


def _int_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return tensor_on(list(values), torch.int32, device)


def _block_table(seqs: Sequence[SeqSlice], block_size: int) -> torch.Tensor:
    """``[B, max_blocks]`` int32: each sequence's blocks up to its last key."""
    rows = [seq.block_ids[:-(-seq.context_len // block_size)] for seq in seqs]
    table = torch.zeros(len(seqs), max((len(r) for r in rows), default=1), dtype=torch.int32)
    for b, row in enumerate(rows):
        table[b, :len(row)] = torch.as_tensor(list(row), dtype=torch.int32)
    return table


def _window_fields(seqs: Sequence[SeqSlice], starts: Sequence[int], decode_ids: List[int],
                   prefill_ids: List[int], sliding_window: Optional[int],
                   device: torch.device) -> dict:
    """The fields that depend on the window."""
    fresh = {i for i in prefill_ids if _is_fresh(seqs[i], sliding_window)}
    decode_keys = (seqs[i].context_len - first_key_position(seqs[i].num_computed, sliding_window)
                   for i in decode_ids)
    return dict(
        cached_prefill_ids=_int_tensor([i for i in prefill_ids if i not in fresh], device),
        fresh_prefills=tuple((starts[i], starts[i] + seqs[i].query_len) for i in sorted(fresh)),
        max_decode_keys=max(decode_keys, default=0),
        sliding_window=sliding_window)


def build_block_table_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    device: torch.device,
    layer_windows: Sequence[Optional[int]],
) -> List[BlockTableMetadata]:
    """Metadata for each layer, given each layer's window (None: full attention); layers with the
    same window share one object; the objects of different windows share all but a few fields."""
    starts, positions, slots = flat_positions_and_slots(seqs, block_size, device)
    decode_ids = [i for i, seq in enumerate(seqs) if seq.query_len == 1]
    prefill_ids = [i for i, seq in enumerate(seqs) if seq.query_len > 1]
    shared = dict(
        num_tokens=len(positions), block_size=block_size, positions=positions, slot_mapping=slots,
        block_table=to_device(_block_table(seqs, block_size), device),
        query_start=_int_tensor(starts, device),
        query_len=_int_tensor((s.query_len for s in seqs), device),
        context_len=_int_tensor((s.context_len for s in seqs), device),
        decode_ids=_int_tensor(decode_ids, device), prefill_ids=_int_tensor(prefill_ids, device),
        num_decodes=len(decode_ids),
        max_query_len=max((seqs[i].query_len for i in prefill_ids), default=0))
    by_window = {
        window: BlockTableMetadata(**shared, **_window_fields(seqs, starts, decode_ids,
                                                              prefill_ids, window, device))
        for window in dict.fromkeys(layer_windows)}
    return [by_window[window] for window in layer_windows]
