"""Batched block copies between a device pool and host slots through a device staging buffer.

A block is ``2 * num_layers`` strided rows of the pool (``[L, 2, slots, H, D]``); a host slot
holds the same rows back to back. Copying a block at a time costs a gather and a copy per block.
Here a batch of blocks costs, per chunk of at most ``capacity`` blocks::

    spill:   index_select  pool blocks -> staging rows      (one kernel)
             copy_         staging rows -> host slots       (one per run of consecutive slots)
    restore: copy_         host slots -> staging rows       (one per run of consecutive slots)
             index_copy_   staging rows -> pool blocks      (one kernel)

plus one small host-to-device copy of the chunk's block ids. (On CUDA PyTorch splits the
scatter into one launch per 2**31 elements of the pool it spans: several for pools over 16 GiB.)
The staging buffer is laid out as the host slots are (block after block, each ``[2L, row]``
contiguous), so a run of consecutive host slots is one copy when a block fills its slot exactly
(``block_nbytes`` a multiple of 4096: block_size 16 with head_dim 64 or more in 16 bits, for
one); otherwise every block is its own copy. Each chunk is sorted by host slot, which makes the
runs as long as the slots allow. Everything is queued on the caller's current stream,
``non_blocking``; the caller synchronizes before reading results.

The same code runs on CPU tensors (synchronously), which is how it is tested. Pure planning
(``plan_chunks``, ``slot_runs``) is separate from the effects (``BlockStaging``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from kv.host_staging import tensor_on
from kv.integrity.checksum import pool_rows
from kv.kv_cache import KVCache, KVCacheSpec
from kv.tiers.host_buffer import HostBuffer

DEFAULT_STAGING_BYTES = 32 << 20


@dataclass(frozen=True)
class SlotRun:
    """Staging rows ``[start, start + length)`` hold host slots ``[slot, slot + length)``."""

    start: int
    slot: int
    length: int


def plan_chunks(slots: Sequence[int], destinations: Sequence[int],
                capacity: int) -> List[List[int]]:
    """The order to copy items in: lists of item indices, each at most ``capacity`` long and
    sorted by ``slots``. Items are cut into segments where a destination repeats, and chunks
    never span a segment, so a destination named twice ends up with the later item's bytes, as
    if the items were copied one by one in order. O(n log n)."""
    if capacity < 1:
        raise ValueError(f"plan_chunks: capacity={capacity}, expected at least 1")
    if len(slots) != len(destinations):
        raise ValueError(f"plan_chunks: {len(slots)} slots for {len(destinations)} destinations")
    chunks: List[List[int]] = []
    segment: List[int] = []
    seen: set = set()
    for index, destination in enumerate(destinations):
        if destination in seen:
            chunks.extend(_cut(segment, slots, capacity))
            segment, seen = [], set()
        segment.append(index)
        seen.add(destination)
    chunks.extend(_cut(segment, slots, capacity))
    return chunks


def _cut(segment: List[int], slots: Sequence[int], capacity: int) -> List[List[int]]:
    ordered = sorted(segment, key=lambda index: slots[index])
    return [ordered[i:i + capacity] for i in range(0, len(ordered), capacity)]


def slot_runs(slots: Sequence[int], can_join: bool) -> List[SlotRun]:
    """Runs of ``slots`` (the host slots of staging rows 0, 1, ...) that one copy can move:
    consecutive rows holding consecutive slots when ``can_join``, else one row each."""
    runs: List[SlotRun] = []
    start = 0
    for row in range(1, len(slots) + 1):
        if row == len(slots) or not can_join or slots[row] != slots[row - 1] + 1:
            runs.append(SlotRun(start, slots[start], row - start))
            start = row
    return runs


def staging_capacity(spec: KVCacheSpec, staging_bytes: int = DEFAULT_STAGING_BYTES) -> int:
    """Blocks a staging buffer of at most ``staging_bytes`` holds: at least one, at most the
    pool's. Its device memory is this times ``spec.bytes_per_block`` (what a pool sizing that
    reserves for the tiers' staging would count)."""
    return max(1, min(spec.num_blocks, staging_bytes // spec.bytes_per_block))


class BlockStaging:
    """A persistent staging buffer of ``capacity`` blocks on the pool's device and the batched
    copies through it (module docstring). Block ids and slots are checked before anything is
    queued: one out of range raises ``IndexError`` and nothing of the batch is copied."""

    def __init__(self, kv_cache: KVCache, host: HostBuffer,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        spec = kv_cache.spec
        self.block_nbytes = spec.bytes_per_block
        self.capacity = staging_capacity(spec, staging_bytes)
        self._host = host
        self._num_blocks = spec.num_blocks
        self._device = kv_cache.data.device
        self._can_join = host.slot_bytes == self.block_nbytes
        rows, row_bytes = pool_rows(kv_cache)  # [2L, blocks * row_bytes]
        word = _word_dtype(row_bytes)
        num_rows = 2 * spec.num_layers
        # [blocks, 2L, row_words]: block b's rows, a strided view of the pool.
        self._pool_blocks = rows.view(word).view(num_rows, -1, row_bytes // _size(word)
                                                 ).transpose(0, 1)
        self._bytes = torch.empty(self.capacity * self.block_nbytes, dtype=torch.uint8,
                                  device=self._device)
        self._rows = self._bytes.view(self.capacity, self.block_nbytes)  # [capacity, bytes]
        self._words = self._bytes.view(word).view(self.capacity, num_rows, -1)
        self.num_kernels = 0  # gathers and scatters queued, for checks and benchmarks
        self.num_copies = 0  # host <-> staging copies queued

    @property
    def nbytes(self) -> int:
        """Device memory the staging buffer holds."""
        return self._bytes.numel()

    def copy_out(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Queue the copies of ``(block, slot)`` pairs from the pool to the host slots."""
        blocks = [block for block, _ in pairs]
        slots = [slot for _, slot in pairs]
        self._check(blocks, slots)
        for chunk in plan_chunks(slots, slots, self.capacity):
            count = len(chunk)
            ids = tensor_on([blocks[i] for i in chunk], torch.int64, self._device)
            torch.index_select(self._pool_blocks, 0, ids, out=self._words[:count])
            self.num_kernels += 1
            for run in slot_runs([slots[i] for i in chunk], self._can_join):
                self._host_rows(run).copy_(self._staged_rows(run), non_blocking=True)
                self.num_copies += 1

    def copy_in(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Queue the copies of ``(slot, block)`` pairs from the host slots into the pool."""
        slots = [slot for slot, _ in pairs]
        blocks = [block for _, block in pairs]
        self._check(blocks, slots)
        for chunk in plan_chunks(slots, blocks, self.capacity):
            count = len(chunk)
            for run in slot_runs([slots[i] for i in chunk], self._can_join):
                self._staged_rows(run).copy_(self._host_rows(run), non_blocking=True)
                self.num_copies += 1
            ids = tensor_on([blocks[i] for i in chunk], torch.int64, self._device)
            self._pool_blocks.index_copy_(0, ids, self._words[:count])
            self.num_kernels += 1

    def _check(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        for name, ids, bound in (("device block", blocks, self._num_blocks),
                                 ("host slot", slots, self._host.num_slots)):
            bad = [i for i in ids if not 0 <= i < bound]
            if bad:
                raise IndexError(f"{name} {bad[0]} out of range, expected 0 <= {name} < {bound}")

    def _staged_rows(self, run: SlotRun) -> torch.Tensor:
        return self._rows[run.start:run.start + run.length].view(-1)  # [length * block_nbytes]

    def _host_rows(self, run: SlotRun) -> torch.Tensor:
        if run.length == 1:
            return self._host.slot(run.slot)  # [block_nbytes]
        return self._host.data[run.slot:run.slot + run.length].view(-1)  # slots fill exactly


def _word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer type a block row is a whole number of: fewer, wider elements for
    the gather and scatter kernels to index."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % _size(dtype) == 0:
            return dtype
    return torch.uint8


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
