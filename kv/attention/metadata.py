"""Per-step indices for paged attention, built once per step (once per distinct sliding window)
and shared by the layers.

A step runs a flat batch of ``T`` new tokens from ``B`` sequences, each contributing ``query_len``
consecutive tokens after ``num_computed`` tokens already in the cache::

    seq b:  [ cached prefix: num_computed ][ this step: query_len ]   context_len = sum of both
             slots from block_table[b]        written to slot_mapping, then attended to as well

Decodes (``query_len == 1``) form buckets of similar context lengths: padded gather indices of
their queries and cached keys and a boolean mask, so each bucket attends in one batched call per
layer (a backend whose decodes skip masked keys without reading them, the CPU decode kernel,
asks for one bucket: a call per layer, not one per 16 decodes). Prefills attend one sequence at
a time (``PrefillSlice``): padding prompts of different lengths to the longest would cost more
than the extra calls, and a prefill without a cached prefix needs no mask at all.

With a sliding window of ``W`` tokens a query at position ``p`` sees the keys ``p-W+1 .. p``, and
only those keys are gathered: a windowed decode costs O(W), not O(context), and a slot before
``first_key_position`` is never read, so the blocks wholly before it may hold anything (the
scheduler frees them once they left the window of every layer)::

    seq b:  [ left the window: never read ][ window of the first query ][ this step ]
             0                             first_key_position           num_computed

Layers with different windows (Qwen2's ``max_window_layers``) get their own buckets and prefills;
positions and slots are shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from kv.host_staging import tensor_on, to_device


DECODE_BUCKET_SIZE = 16


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step: its query length, cached length and block ids."""

    query_len: int
    num_computed: int
    block_ids: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.num_computed + self.query_len


@dataclass(frozen=True)
class AttentionBucket:
    """Padded gather indices for ``B`` sequences of one bucket."""

    query_index: torch.Tensor  # [B, max_q] rows of the flat batch; padding points at row T
    kv_slots: torch.Tensor  # [B, K] slots of the keys from the first visible one; padding
    #                         repeats the sequence's last slot
    mask: torch.Tensor  # [B, 1, max_q, K] True where the query may attend to the key
    # [num valid] positions of the real (unpadded) query rows in [B * max_q]: built on the host,
    # so picking them out is a gather, not a boolean index (which syncs the host on CUDA)
    valid_rows: torch.Tensor
    token_index: torch.Tensor  # [num valid] rows of the flat batch, in the order of valid rows


@dataclass(frozen=True)
class PrefillSlice:
    """One prefilling sequence: rows ``start:end`` of the flat batch attend to ``kv_slots``."""

    start: int
    end: int
    kv_slots: torch.Tensor  # [K] slots of the keys its queries may see, in position order
    mask: Optional[torch.Tensor]  # [1, 1, query_len, K]; None: plain causal
    # Keys before the chunk that every query sees (a cached prefix, no window cutting it): then
    # the mask is exactly "all of those, causal over the rest", which a backend may split.
    num_prefix_keys: int = 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a layer needs to write and read the paged KV cache for one step."""

    num_tokens: int
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    buckets: List[AttentionBucket]  # the decodes, batched
    prefills: List[PrefillSlice]
    sliding_window: Optional[int] = None  # the window these indices apply, None: full attention


def first_key_position(num_computed: int, sliding_window: Optional[int]) -> int:
    """The first position that a query at ``num_computed`` or later may attend to: the keys
    before it have left the window for good (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, num_computed - sliding_window + 1)


def flat_positions_and_slots(seqs: Sequence[SeqSlice], block_size: int, device: torch.device
                             ) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
    """Each sequence's first row in the flat batch, and the ``[T]`` positions and cache slots of
    the step's new tokens (what every attention backend needs to write K/V and apply RoPE)."""
    starts, positions, slots = [], [], []
    offset = 0
    for seq in seqs:
        starts.append(offset)
        offset += seq.query_len
        pos = range(seq.num_computed, seq.context_len)
        positions.extend(pos)
        slots.extend(seq.block_ids[p // block_size] * block_size + p % block_size for p in pos)
    return (starts, tensor_on(positions, torch.long, device),
            tensor_on(slots, torch.long, device))


def build_attention_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    device: torch.device,
    sliding_window: Optional[int] = None,
    decode_bucket_size: Optional[int] = DECODE_BUCKET_SIZE,
) -> AttentionMetadata:
    """Indices for a step whose flat batch holds ``seqs``' new tokens in order."""
    return build_layer_metadata(seqs, block_size, device, [sliding_window],
                                decode_bucket_size)[0]


def build_layer_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    device: torch.device,
    layer_windows: Sequence[Optional[int]],
    decode_bucket_size: Optional[int] = DECODE_BUCKET_SIZE,
) -> List[AttentionMetadata]:
    """Indices for each layer, given each layer's window (None: full attention), with at most
    ``decode_bucket_size`` decodes a bucket (None: all of them in one).

    Layers with the same window share one object: a model whose layers all have the same window
    builds its indices once, one mixing full and windowed layers twice. Cost per window: O(T)
    plus the gather indices, O(sum over decodes of the keys they see)."""
    if decode_bucket_size is not None and decode_bucket_size < 1:
        raise ValueError(f"decode_bucket_size must be at least 1 or None, got {decode_bucket_size}")
    starts, positions_t, slots_t = flat_positions_and_slots(seqs, block_size, device)
    num_tokens = len(positions_t)
    # Decodes sorted by context length, in buckets of similar lengths: each bucket pads its
    # gathered K/V only to its own longest context.
    decodes = sorted((i for i, s in enumerate(seqs) if s.query_len == 1),
                     key=lambda i: seqs[i].context_len)
    size = decode_bucket_size or max(1, len(decodes))
    groups = [decodes[k:k + size] for k in range(0, len(decodes), size)]
    by_window = {}
    for window in dict.fromkeys(layer_windows):
        buckets = [_build_bucket([seqs[i] for i in group], [starts[i] for i in group], num_tokens,
                                 block_size, device, window) for group in groups]
        prefills = [_build_prefill(seq, start, block_size, device, window)
                    for seq, start in zip(seqs, starts) if seq.query_len > 1]
        by_window[window] = AttentionMetadata(num_tokens, positions_t, slots_t, buckets, prefills,
                                              window)
    return [by_window[window] for window in layer_windows]


def _build_prefill(seq: SeqSlice, start: int, block_size: int, device: torch.device,
                   sliding_window: Optional[int]) -> PrefillSlice:
    first = first_key_position(seq.num_computed, sliding_window)
    key_pos = torch.arange(first, seq.context_len)  # [K] the keys this chunk's queries may see
    first_block = first // block_size
    blocks = torch.as_tensor(
        list(seq.block_ids[first_block:-(-seq.context_len // block_size)]), dtype=torch.long)
    kv_slots = blocks[key_pos // block_size - first_block] * block_size + key_pos % block_size
    mask = None
    num_prefix_keys = 0
    windowed = sliding_window is not None and seq.context_len > sliding_window
    if seq.num_computed or windowed:  # a cached prefix shifts the diagonal; a window cuts it
        q_pos = torch.arange(seq.num_computed, seq.context_len)[:, None]  # [q, 1]
        mask = key_pos[None, :] <= q_pos  # [q, K]
        if windowed:
            mask &= key_pos[None, :] > q_pos - sliding_window
        else:
            num_prefix_keys = seq.num_computed - first
        mask = to_device(mask[None, None], device)
    return PrefillSlice(start, start + seq.query_len, to_device(kv_slots, device), mask,
                        num_prefix_keys)


def _key_slots(seqs: Sequence[SeqSlice], first: torch.Tensor, max_keys: int,
               block_size: int) -> torch.Tensor:
    """``[B, max_keys]`` cache slots of the keys at positions ``first[b] + j``; the padding past
    a sequence's last key repeats that key's slot (the mask hides it)."""
    context_len = torch.tensor([s.context_len for s in seqs])  # [B]
    key_pos = first[:, None] + torch.arange(max_keys)[None, :]  # [B, K]
    key_pos = torch.minimum(key_pos, context_len[:, None] - 1)
    first_block = first // block_size  # [B]
    rows = [list(s.block_ids[f:-(-s.context_len // block_size)])
            for s, f in zip(seqs, first_block.tolist())]
    width = max(len(r) for r in rows)
    # [B, blocks], rows padded with block 0 (never gathered: the key positions stop short)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    block_index = key_pos // block_size - first_block[:, None]  # [B, K]
    return table.gather(1, block_index) * block_size + key_pos % block_size


def _build_bucket(
    seqs: Sequence[SeqSlice], starts: Sequence[int], num_tokens: int, block_size: int,
    device: torch.device, sliding_window: Optional[int],
) -> AttentionBucket:
    max_q = max(s.query_len for s in seqs)
    query_len = torch.tensor([s.query_len for s in seqs])  # [B]
    context_len = torch.tensor([s.context_len for s in seqs])  # [B]
    first = torch.tensor([first_key_position(s.num_computed, sliding_window) for s in seqs])
    max_keys = int((context_len - first).max())
    kv_slots = _key_slots(seqs, first, max_keys, block_size)  # [B, K]
    key_pos = first[:, None] + torch.arange(max_keys)[None, :]  # [B, K]

    q_offset = torch.arange(max_q)  # [max_q]
    valid_q = q_offset[None, :] < query_len[:, None]  # [B, max_q]
    query_index = torch.tensor(starts)[:, None] + q_offset[None, :]
    query_index = torch.where(valid_q, query_index, torch.full_like(query_index, num_tokens))
    # Absolute position of each query; a key is visible if it is not after the query.
    q_pos = (context_len - query_len)[:, None] + q_offset[None, :]  # [B, max_q]
    mask = key_pos[:, None, :] <= q_pos[:, :, None]  # [B, max_q, K]
    if sliding_window is not None:
        mask &= key_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    mask &= valid_q[:, :, None]
    mask[:, :, 0] |= ~valid_q  # padding rows look at one key so softmax stays finite
    valid = valid_q.reshape(-1)
    return AttentionBucket(
        query_index=to_device(query_index, device),
        kv_slots=to_device(kv_slots, device),
        mask=to_device(mask[:, None], device),
        valid_rows=to_device(valid.nonzero()[:, 0], device),
        token_index=to_device(query_index.reshape(-1)[valid], device),
    )
