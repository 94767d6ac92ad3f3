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

import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kv.attention.metadata import SeqSlice, first_key_position, flat_positions_and_slots
from kv.attention.device_block_tables import DeviceBlockTables
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


def _is_fresh(seq: Union[SeqSlice, "DeviceSeq"], sliding_window: Optional[int]) -> bool:
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


def _cached_prefill_ids(seqs: Sequence[Union[SeqSlice, "DeviceSeq"]], prefill_ids: List[int],
                        sliding_window: Optional[int]) -> List[int]:
    return [i for i in prefill_ids if not _is_fresh(seqs[i], sliding_window)]


def _window_fields(seqs: Sequence[Union[SeqSlice, "DeviceSeq"]], starts: Sequence[int],
                   decode_ids: List[int], prefill_ids: List[int],
                   sliding_window: Optional[int]) -> dict:
    """The host-side fields that depend on the window (all but ``cached_prefill_ids``)."""
    fresh = {i for i in prefill_ids if _is_fresh(seqs[i], sliding_window)}
    decode_keys = (seqs[i].context_len - first_key_position(seqs[i].num_computed, sliding_window)
                   for i in decode_ids)
    return dict(
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
        window: BlockTableMetadata(
            **shared, **_window_fields(seqs, starts, decode_ids, prefill_ids, window),
            cached_prefill_ids=_int_tensor(_cached_prefill_ids(seqs, prefill_ids, window), device))
        for window in dict.fromkeys(layer_windows)}
    return [by_window[window] for window in layer_windows]


@dataclass(frozen=True)
class DeviceSeq:
    """One sequence of a step whose block table lives in a ``DeviceBlockTables`` row."""

    row: int  # its row of the device tables
    query_len: int  # new tokens this step
    num_computed: int  # tokens already in the cache

    @property
    def context_len(self) -> int:
        return self.num_computed + self.query_len


@dataclass(frozen=True)
class DeviceStep:
    """A step's inputs on the device: token ids, the rows to take logits of, each layer's metadata."""

    input_ids: torch.Tensor  # [T] int64
    logit_rows: torch.Tensor  # [N] int64 rows of the flat batch that are sampled
    metadata: List[BlockTableMetadata]


# Every part starts a multiple of 4 int32s (16 bytes) into the copy: Triton specializes a kernel
# on each pointer argument's 16-byte alignment, so slices at offsets that follow the batch's
# sizes would compile the kernels again for new step shapes.
_PART_ALIGN = 4


class _Packed:
    """Host ints of a step, sent to the device in one copy and read back there as slices."""

    def __init__(self) -> None:
        self._parts: List[Sequence[int]] = []

    def add(self, values: Sequence[int]) -> int:
        self._parts.append(values)
        return len(self._parts) - 1

    def send(self, device: torch.device) -> List[torch.Tensor]:
        flat: List[int] = []
        starts = []
        for part in self._parts:
            starts.append(len(flat))
            flat.extend(part)
            flat.extend([0] * (-len(flat) % _PART_ALIGN))
        sent = tensor_on(flat, torch.int32, device)  # [parts, each padded to _PART_ALIGN]
        return [sent[start:start + len(part)] for start, part in zip(starts, self._parts)]


def build_device_step(
    tables: DeviceBlockTables,
    seqs: Sequence[DeviceSeq],
    input_ids: Sequence[int],
    logit_rows: Sequence[int],
    block_size: int,
    layer_windows: Sequence[Optional[int]],
) -> DeviceStep:
    """The step's inputs and per-layer metadata, with one host-to-device copy (every int the host
    knows, packed) and the rest built on the device: context lengths, positions, slot mapping and
    the step's block table (rows gathered from ``tables``, whose staged diffs must be flushed).
    The host computes only what the launch needs (counts, maxima, which prefills are fresh)."""
    device = tables.device
    starts = list(itertools.accumulate((s.query_len for s in seqs), initial=0))[:-1]
    decode_ids = [i for i, seq in enumerate(seqs) if seq.query_len == 1]
    prefill_ids = [i for i, seq in enumerate(seqs) if seq.query_len > 1]
    windows = list(dict.fromkeys(layer_windows))
    packed = _Packed()
    for part in ([s.row for s in seqs], [s.query_len for s in seqs],
                 [s.num_computed for s in seqs], starts, decode_ids, prefill_ids, input_ids,
                 logit_rows):
        packed.add(part)
    for window in windows:
        packed.add(_cached_prefill_ids(seqs, prefill_ids, window))
    (rows, query_len, num_computed, query_start, decode_t, prefill_t, ids_t, logit_t,
     *cached_t) = packed.send(device)

    num_tokens = len(input_ids)
    if len(prefill_ids):  # token t belongs to sequence seq_of[t]
        seq_of = torch.repeat_interleave(torch.arange(len(seqs), device=device), query_len,
                                         output_size=num_tokens)  # [T]
    else:
        seq_of = torch.arange(len(seqs), device=device)  # decodes only: one token each
    positions = (num_computed[seq_of] + torch.arange(num_tokens, device=device)
                 - query_start[seq_of]).long()  # [T]
    num_columns = -(-max(s.context_len for s in seqs) // block_size)
    block_table = tables.gather(rows.long(), num_columns)  # [B, blocks]
    slots = (block_table[seq_of, positions // block_size].long() * block_size
             + positions % block_size)  # [T]
    shared = dict(
        num_tokens=num_tokens, block_size=block_size, positions=positions, slot_mapping=slots,
        block_table=block_table, query_start=query_start, query_len=query_len,
        context_len=num_computed + query_len, decode_ids=decode_t, prefill_ids=prefill_t,
        num_decodes=len(decode_ids),
        max_query_len=max((seqs[i].query_len for i in prefill_ids), default=0))
    by_window = {}
    for window, cached in zip(windows, cached_t):
        by_window[window] = BlockTableMetadata(
            **shared, **_window_fields(seqs, starts, decode_ids, prefill_ids, window),
            cached_prefill_ids=cached)
    return DeviceStep(ids_t.long(), logit_t.long(), [by_window[w] for w in layer_windows])
