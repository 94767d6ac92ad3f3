"""Whole-block copies between one rank's device pool and its host slots, checksummed on the way.

A device block is ``2 * num_layers`` strided rows of ``block_size * H * D`` elements in the pool
(``[L, 2, slots, H, D]``); a host slot holds the same rows back to back. How the bytes move:

- Staged (CUDA pools; CPU pools with ``staged=True``, how it is tested): a batch goes through a
  persistent device staging buffer, one gather or scatter kernel and one copy per run of
  consecutive host slots per chunk of blocks (``kv/tiers/block_staging.py``), queued on the
  caller's stream (the copy stream) from and to pinned memory.
- Per block with numpy (CPU pools by default), on a few threads (each takes the next block when
  done).

Which checksum and where it runs is the ``BlockChecksum`` strategy
(``kv/integrity/block_checksum.py``):

- Host hashing (CPU pools; CUDA pools without CuPy). Per block on CPU, each thread copies a
  block and hashes it while it is still in cache (numpy byte copies and xxh3 both release the
  GIL), so a batch costs about one pass over memory rather than a copy pass plus a hashing pass.
  Staged, the host hashes the slots on the threads once the stream has finished (a spill) or
  before any copy (a restore, which copies only the slots that match).
- Device hashing (CUDA with CuPy). A spill hashes its blocks in the pool (one launch for the
  batch) before their copies on the same stream and brings the checksums back in one small copy;
  a restore copies first, hashes the destination blocks, compares on the device and brings the
  mismatch flags back in one small copy. The host never hashes on this path. The same code runs
  on CPU with ``ReferenceBlockHasher`` (the kernel's numpy twin), which is how it is tested.

Costs: O(bytes) per batch. A block or slot out of range fails only its item; any other failure
fails the items it touched (one block per block copy, the batch's blocks for a staged batch).
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
import torch

from kv.host_staging import tensor_on
from kv.integrity.block_checksum import BlockChecksum, choose_block_checksum
from kv.tiers.block_staging import DEFAULT_STAGING_BYTES, BlockStaging
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class BlockCopier:
    """Copies blocks out to host slots (returning their checksums) and back in (verifying them).

    ``staged``: copy through a device staging buffer of ``staging_bytes`` (default: on CUDA,
    where it is the only way; on CPU it is there for tests)."""

    def __init__(self, kv_cache: KVCache, host: HostBuffer, num_threads: int = 2,
                 checksum: Optional[BlockChecksum] = None, staged: Optional[bool] = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        spec = kv_cache.spec
        self.checksum = checksum if checksum is not None else choose_block_checksum(kv_cache)
        self._hasher = self.checksum.device
        self._kv = kv_cache
        self._host = host
        self._num_blocks = spec.num_blocks
        self.is_cuda = kv_cache.data.is_cuda
        if self.is_cuda and staged is False:
            raise ValueError("BlockCopier: staged=False copies with numpy, CPU pools only; "
                             "a CUDA pool copies through the staging buffer (staged=None)")
        is_staged = self.is_cuda if staged is None else staged
        self.staging = BlockStaging(kv_cache, host, staging_bytes) if is_staged else None
        self._rows = 2 * spec.num_layers
        itemsize = kv_cache.data.element_size()
        self._row_bytes = spec.block_size * spec.num_kv_heads * spec.head_dim * itemsize
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tpserve-kv-copy")
        self._num_threads = num_threads
        self._host_bytes = host.data.numpy()  # [slots, slot_bytes]
        if not self.is_cuda:
            # [2L, slots * H * D * itemsize] bytes: block b is columns [b, b + 1) * row_bytes.
            self._device_bytes = kv_cache.data.view(self._rows, -1).view(torch.uint8).numpy()

    def copy_out(self, pairs: Sequence[Tuple[int, int]],
                 on_device_read: Callable[[], None]) -> List[Optional[int]]:
        """Copy device blocks to host slots (``(block, slot)`` pairs); the checksum of each slot
        written, or None where the copy failed. ``on_device_read`` is called once the device
        blocks have been read (numpy) or their copies are queued on the current stream
        (staged)."""
        if self._hasher is not None:
            return self._copy_out_hashed_on_device(pairs, on_device_read)
        if self.staging is None:
            checksums = self._parallel(self._copy_out_and_hash, pairs)
            on_device_read()
            return checksums
        copied = self._move(pairs, out=True)
        on_device_read()
        self._synchronize()
        slots = [slot for (_, slot), ok in zip(pairs, copied) if ok]
        sums = iter(self.checksums(slots))
        return [next(sums) if ok else None for ok in copied]

    def copy_in(self, items: Sequence[Tuple[int, int, Optional[int]]]) -> List[Optional[bool]]:
        """Copy host slots to device blocks (``(slot, block, expected checksum)``) and check the
        bytes against the checksum: True where the block was written intact, False where the bytes
        did not match, None where the copy failed. On a False or None the destination block must
        not be attended to: numpy copies and device hashing copy before they check, so it may
        hold the bad bytes (a fresh block of a restore, recomputed before anyone reads it);
        staged copies hashed on the host check first and leave it alone. An item without a checksum is refused
        before any copy."""
        if self._hasher is not None:
            return self._copy_in_verified_on_device(items)
        if self.staging is None:
            return self._parallel(self._copy_in_and_verify, items)
        intact = self._parallel(self._verify, items)
        chosen = [i for i, ok in enumerate(intact) if ok]
        moved = iter(self._move([items[i][:2] for i in chosen], out=False))
        written = [next(moved) if ok else ok for ok in intact]
        self._synchronize()
        return written

    def checksums(self, slots: Sequence[int]) -> List[int]:
        """Checksums of host slots by the strategy's host function, on the copier's threads."""
        return self._parallel(self._slot_checksum, slots)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ----- hashed on the device -----

    def _copy_out_hashed_on_device(self, pairs: Sequence[Tuple[int, int]],
                                   on_device_read: Callable[[], None]) -> List[Optional[int]]:
        """Hash the blocks in the pool, queue their copies and the checksums' copy behind it on
        the same stream, then wait once."""
        assert self._hasher is not None
        valid = [self._is_block(block) for block, _ in pairs]  # the others fail alone
        blocks = [block for (block, _), ok in zip(pairs, valid) if ok]
        sums = self._to_host(self._hasher.hash_blocks(blocks))  # [len(blocks)]
        moved = iter(self._move([pair for pair, ok in zip(pairs, valid) if ok], out=True))
        copied = [next(moved) if ok else None for ok in valid]
        on_device_read()
        self._synchronize()
        values = iter(sums.tolist())  # one per valid block, copied or not
        return [_checksum_if(next(values), ok) if is_valid else None
                for is_valid, ok in zip(valid, copied)]

    def _copy_in_verified_on_device(self, items: Sequence[Tuple[int, int, Optional[int]]]
                                    ) -> List[Optional[bool]]:
        """Queue the copies, hash the written blocks and compare with the expected checksums on
        the device; one wait, one small copy of the mismatch flags."""
        assert self._hasher is not None
        chosen = [i for i, (_, _, expected) in enumerate(items) if expected is not None]
        moved = iter(self._move([items[i][:2] for i in chosen], out=False))
        written: List[Optional[bool]] = [next(moved) if expected is not None else False
                                         for _, _, expected in items]
        checked = [i for i, ok in enumerate(written) if ok]
        sums = self._hasher.hash_blocks([items[i][1] for i in checked])  # [len(checked)]
        expected = tensor_on([_signed(items[i][2]) for i in checked], torch.int64, sums.device)
        mismatch = self._to_host(sums != expected)
        self._synchronize()
        for i, is_bad in zip(checked, mismatch.tolist()):
            written[i] = not is_bad
        return written

    def _to_host(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` queued for a non-blocking copy to pinned host memory (CUDA), or as is."""
        if not values.is_cuda:
            return values
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        return host.copy_(values, non_blocking=True)

    def _synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self._kv.data.device).synchronize()

    def _move(self, pairs: Sequence[Tuple[int, int]], out: bool) -> List[Optional[bool]]:
        """Copy ``(block, slot)`` pairs out, or ``(slot, block)`` pairs in, without hashing: True
        where the copy was done (numpy) or queued (staged), None where it failed."""
        if self.staging is None:
            return self._parallel(self._copy_rows_out if out else self._copy_rows_in, pairs)
        pairs_out = [pair if out else pair[::-1] for pair in pairs]
        valid = [self._is_block(block) and self._is_slot(slot) for block, slot in pairs_out]
        chosen = [pair for pair, ok in zip(pairs, valid) if ok]
        try:
            (self.staging.copy_out if out else self.staging.copy_in)(chosen)
            result: Optional[bool] = True
        except Exception:
            logger.exception("KV block copy of %d blocks %s failed", len(chosen),
                             "out" if out else "in")
            result = None
        return [result if ok else None for ok in valid]

    def _is_slot(self, slot: int) -> bool:
        if 0 <= slot < self._host.num_slots:
            return True
        logger.error("KV block copy: host slot %d out of range, expected 0 <= slot < %d",
                     slot, self._host.num_slots)
        return False

    def _is_block(self, block: int) -> bool:
        if 0 <= block < self._num_blocks:
            return True
        logger.error("KV block copy: device block %d out of range, expected 0 <= block < %d",
                     block, self._num_blocks)
        return False

    # ----- per block -----

    def _copy_out_and_hash(self, pair: Tuple[int, int]) -> int:
        self._copy_rows_out(pair)
        return self._slot_checksum(pair[1])  # hot in cache right after the copy

    def _verify(self, item: Tuple[int, int, Optional[int]]) -> bool:
        slot, _, expected = item
        return expected is not None and self._slot_checksum(slot) == expected

    def _copy_in_and_verify(self, item: Tuple[int, int, Optional[int]]) -> bool:
        """Copy, then hash the slot while the copy has left it in cache: the bytes come from
        memory once (hashing first read them twice: 0.57-0.61 of a plain copy's speed per core
        against 0.69-0.70 measured here)."""
        slot, block, expected = item
        if expected is None:
            return False
        np.copyto(self._device_rows(block), self._host_rows(slot))
        return self._slot_checksum(slot) == expected

    def _copy_rows_out(self, pair: Tuple[int, int]) -> bool:
        block, slot = pair
        np.copyto(self._host_rows(slot), self._device_rows(block))
        return True

    def _copy_rows_in(self, pair: Tuple[int, int]) -> bool:
        slot, block = pair
        np.copyto(self._device_rows(block), self._host_rows(slot))
        return True

    def _slot_checksum(self, slot: int) -> int:
        return self.checksum.host(self._host_bytes[slot, :self._host.block_nbytes])

    def _device_rows(self, block: int) -> np.ndarray:
        self._check_block(block)
        start = block * self._row_bytes
        return self._device_bytes[:, start:start + self._row_bytes]  # [2L, row_bytes]

    def _host_rows(self, slot: int) -> np.ndarray:
        return self._host_bytes[slot, :self._host.block_nbytes].reshape(self._rows, self._row_bytes)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise IndexError(f"device block {block} out of range, expected 0 <= block < "
                             f"{self._num_blocks}")

    # ----- threads -----

    def _parallel(self, fn: Callable[[T], R], items: Sequence[T]) -> List[Optional[R]]:
        """``fn`` over ``items`` on the copier's threads; an item whose call raises gets None
        (logged). Each thread takes the next item as it finishes one, not a fixed share: on a
        busy host a thread can lose its core for a scheduler slice mid-batch, and the other
        threads then carry on with the rest instead of waiting (measured on 2 cores shared with
        other jobs: restores of 256 blocks 0.61-0.90 of a plain copy_ against 0.41-0.72 with
        fixed interleaved shares)."""
        if len(items) <= 1 or self._num_threads == 1:
            return [_guarded(fn, item) for item in items]
        results: List[Optional[R]] = [None] * len(items)
        next_index = itertools.count().__next__  # atomic: one C call under the GIL

        def run() -> None:
            while (index := next_index()) < len(items):
                results[index] = _guarded(fn, items[index])

        for future in [self._pool.submit(run) for _ in range(self._num_threads)]:
            future.result()
        return results


def _signed(value: int) -> int:
    """A uint64 checksum as the int64 with the same bits (torch has no uint64 comparisons)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _checksum_if(value: int, is_copied: Optional[bool]) -> Optional[int]:
    """The uint64 checksum of a block whose copy was queued, else None."""
    return value & 0xFFFFFFFFFFFFFFFF if is_copied else None


def _guarded(fn: Callable[[T], R], item: T) -> Optional[R]:
    try:
        return fn(item)
    except Exception:
        logger.exception("KV block copy %s failed", item)
        return None
