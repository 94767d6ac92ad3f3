"""Per-step indices for paged attention, built once per step and shared by every layer.

A step runs a flat batch of ``T`` new tokens from ``B`` sequences, each contributing ``query_len``
consecutive tokens after ``num_computed`` tokens already in the cache::

    seq b:  [ cached prefix: num_computed ][ this step: query_len ]   context_len = sum of both
             slots from block_table[b]        written to slot_mapping, then attended to as well

Decodes (``query_len == 1``) form buckets of similar context lengths: padded gather indices of their queries and cached
keys and a boolean mask, so each bucket attends in one batched call per layer. Prefills attend one
sequence at a time (``PrefillSlice``): padding prompts of different lengths to the longest would
cost more than the extra calls, and a prefill without a cached prefix needs no mask at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


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
    kv_slots: torch.Tensor  # [B, max_ctx] cache slots of every key; padding points at slot 0
    mask: torch.Tensor  # [B, 1, max_q, max_ctx] True where the query may attend to the key
    valid: torch.Tensor  # [B * max_q] True for real (unpadded) query rows
    token_index: torch.Tensor  # [num valid] rows of the flat batch, in the order of valid rows


@dataclass(frozen=True)
class PrefillSlice:
    """One prefilling sequence: rows ``start:end`` of the flat batch attend to ``kv_slots``."""

    start: int
    end: int
    kv_slots: torch.Tensor  # [context_len] cache slots of its keys, in position order
    mask: Optional[torch.Tensor]  # [1, 1, query_len, context_len]; None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a layer needs to write and read the paged KV cache for one step."""

    num_tokens: int
    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V goes to
    buckets: List[AttentionBucket]  # the decodes, batched
    prefills: List[PrefillSlice]


def build_attention_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    device: torch.device,
    sliding_window: Optional[int] = None,
) -> AttentionMetadata:
    """Indices for a step whose flat batch holds ``seqs``' new tokens in order."""
    starts, positions, slots = [], [], []
    offset = 0
    for seq in seqs:
        starts.append(offset)
        offset += seq.query_len
        pos = range(seq.num_computed, seq.context_len)
        positions.extend(pos)
        slots.extend(seq.block_ids[p // block_size] * block_size + p % block_size for p in pos)
    # Decodes sorted by context length, in buckets of similar lengths: each bucket pads its
    # gathered K/V only to its own longest context.
    decodes = sorted((i for i, s in enumerate(seqs) if s.query_len == 1),
                     key=lambda i: seqs[i].context_len)
    buckets = [
        _build_bucket([seqs[i] for i in group], [starts[i] for i in group], offset, block_size,
                      device, sliding_window)
        for group in (decodes[k:k + DECODE_BUCKET_SIZE]
                      for k in range(0, len(decodes), DECODE_BUCKET_SIZE))
    ]
    prefills = [_build_prefill(seq, start, block_size, device, sliding_window)
                for seq, start in zip(seqs, starts) if seq.query_len > 1]
    return AttentionMetadata(
        num_tokens=offset,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        buckets=buckets,
        prefills=prefills,
    )


def _build_prefill(seq: SeqSlice, start: int, block_size: int, device: torch.device,
                   sliding_window: Optional[int]) -> PrefillSlice:
    key_pos = torch.arange(seq.context_len)  # [ctx]
    blocks = torch.as_tensor(list(seq.block_ids[:-(-seq.context_len // block_size)]))
    kv_slots = blocks[key_pos // block_size] * block_size + key_pos % block_size
    mask = None
    windowed = sliding_window is not None and seq.context_len > sliding_window
    if seq.num_computed or windowed:  # a cached prefix shifts the diagonal; a window cuts it
        q_pos = torch.arange(seq.num_computed, seq.context_len)[:, None]  # [q, 1]
        mask = key_pos[None, :] <= q_pos
        if windowed:
            mask &= key_pos[None, :] > q_pos - sliding_window
        mask = mask[None, None].to(device)
    return PrefillSlice(start, start + seq.query_len, kv_slots.to(device), mask)


def _build_bucket(
    seqs: Sequence[SeqSlice], starts: Sequence[int], num_tokens: int, block_size: int,
    device: torch.device, sliding_window: Optional[int],
) -> AttentionBucket:
    num_seqs = len(seqs)
    max_q = max(s.query_len for s in seqs)
    max_ctx = max(s.context_len for s in seqs)
    max_blocks = (max_ctx + block_size - 1) // block_size
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    for b, seq in enumerate(seqs):
        used = (seq.context_len + block_size - 1) // block_size
        table[b, :used] = torch.as_tensor(list(seq.block_ids[:used]), dtype=torch.long)
    key_pos = torch.arange(max_ctx)  # [max_ctx]
    kv_slots = table[:, key_pos // block_size] * block_size + key_pos % block_size

    query_len = torch.tensor([s.query_len for s in seqs])  # [B]
    context_len = torch.tensor([s.context_len for s in seqs])  # [B]
    q_offset = torch.arange(max_q)  # [max_q]
    valid_q = q_offset[None, :] < query_len[:, None]  # [B, max_q]
    query_index = torch.tensor(starts)[:, None] + q_offset[None, :]
    query_index = torch.where(valid_q, query_index, torch.full_like(query_index, num_tokens))
    # Absolute position of each query; a key is visible if it is not after the query.
    q_pos = (context_len - query_len)[:, None] + q_offset[None, :]  # [B, max_q]
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, max_ctx]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask &= valid_q[:, :, None]
    mask[:, :, 0] |= ~valid_q  # padding rows look at one key so softmax stays finite
    valid = valid_q.reshape(-1)
    return AttentionBucket(
        query_index=query_index.to(device),
        kv_slots=kv_slots.to(device),
        mask=mask[:, None].to(device),
        valid=valid.to(device),
        token_index=query_index.reshape(-1)[valid].to(device),
    )
