"""Whole-block copies between one rank's device pool and its host slots, checksummed on the way.

A device block is ``2 * num_layers`` strided rows of ``block_size * H * D`` elements in the pool
(``[L, 2, slots, H, D]``); a host slot holds the same rows back to back. On CPU the blocks of a
batch are split over a few threads, each copying a block and hashing it while it is still in
cache (numpy byte copies and xxh3 both release the GIL), so a batch costs about one pass over
memory rather than a copy pass plus a hashing pass. On CUDA the copies run on the caller's copy
stream from pinned memory; the host hashes once the stream has finished.

Costs: O(bytes) per batch; a failure of one block (an exception) fails only that block.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
import torch

from kv.checksum import block_checksum
from kv.host_buffer import HostBuffer
from kv.kv_cache import KVCache

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class BlockCopier:
    """Copies blocks out to host slots (returning their checksums) and back in (verifying them)."""

    def __init__(self, kv_cache: KVCache, host: HostBuffer, num_threads: int = 2) -> None:
        spec = kv_cache.spec
        self._kv = kv_cache
        self._host = host
        self._num_blocks = spec.num_blocks
        self.is_cuda = kv_cache.data.is_cuda
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
        blocks have been read (CPU) or the copies are queued on the current stream (CUDA)."""
        if not self.is_cuda:
            checksums = self._parallel(self._copy_out_and_hash, pairs)
            on_device_read()
            return checksums
        copied = [_guarded(self._cuda_copy_out, pair) for pair in pairs]
        on_device_read()
        torch.cuda.current_stream(self._kv.data.device).synchronize()
        slots = [slot for (_, slot), ok in zip(pairs, copied) if ok]
        sums = iter(self.checksums(slots))
        return [next(sums) if ok else None for ok in copied]

    def copy_in(self, items: Sequence[Tuple[int, int, Optional[int]]]) -> List[Optional[bool]]:
        """Copy host slots to device blocks (``(slot, block, expected checksum)``) where the
        slot's bytes still match the checksum: True where the block was written, False where
        the bytes did not match (the block is left alone), None where the copy failed."""
        if not self.is_cuda:
            return self._parallel(self._verify_and_copy_in, items)
        intact = self._parallel(self._verify, items)
        written: List[Optional[bool]] = [
            _guarded(self._cuda_copy_in, (slot, block)) if ok else ok
            for (slot, block, _), ok in zip(items, intact)]
        torch.cuda.current_stream(self._kv.data.device).synchronize()
        return written

    def checksums(self, slots: Sequence[int]) -> List[int]:
        """Checksums of host slots, hashed on the copier's threads."""
        return self._parallel(self._slot_checksum, slots)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ----- per block -----

    def _copy_out_and_hash(self, pair: Tuple[int, int]) -> int:
        block, slot = pair
        np.copyto(self._host_rows(slot), self._device_rows(block))
        return self._slot_checksum(slot)  # hot in cache right after the copy

    def _verify(self, item: Tuple[int, int, Optional[int]]) -> bool:
        slot, _, expected = item
        return expected is not None and self._slot_checksum(slot) == expected

    def _verify_and_copy_in(self, item: Tuple[int, int, Optional[int]]) -> bool:
        if not self._verify(item):  # hashing first leaves the bytes in cache for the copy
            return False
        slot, block, _ = item
        np.copyto(self._device_rows(block), self._host_rows(slot))
        return True

    def _cuda_copy_out(self, pair: Tuple[int, int]) -> bool:
        block, slot = pair
        self._host_block(slot).copy_(self._device_block(block), non_blocking=True)
        return True

    def _cuda_copy_in(self, pair: Tuple[int, int]) -> bool:
        slot, block = pair
        self._device_block(block).copy_(self._host_block(slot), non_blocking=True)
        return True

    def _slot_checksum(self, slot: int) -> int:
        return block_checksum(self._host_bytes[slot, :self._host.block_nbytes])

    def _device_rows(self, block: int) -> np.ndarray:
        self._check_block(block)
        start = block * self._row_bytes
        return self._device_bytes[:, start:start + self._row_bytes]  # [2L, row_bytes]

    def _host_rows(self, slot: int) -> np.ndarray:
        return self._host_bytes[slot, :self._host.block_nbytes].reshape(self._rows, self._row_bytes)

    def _device_block(self, block: int) -> torch.Tensor:
        self._check_block(block)
        bs = self._kv.spec.block_size
        return self._kv.data[:, :, block * bs:(block + 1) * bs]  # [L, 2, bs, H, D]

    def _host_block(self, slot: int) -> torch.Tensor:
        spec = self._kv.spec
        return self._host.slot(slot).view(spec.dtype).view(
            spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise IndexError(f"device block {block} out of range, expected 0 <= block < "
                             f"{self._num_blocks}")

    # ----- threads -----

    def _parallel(self, fn: Callable[[T], R], items: Sequence[T]) -> List[Optional[R]]:
        """``fn`` over ``items`` on the copier's threads (interleaved shares, one task per
        thread); an item whose call raises gets None (logged)."""
        if len(items) <= 1 or self._num_threads == 1:
            return [_guarded(fn, item) for item in items]
        shares = [range(i, len(items), self._num_threads) for i in range(self._num_threads)]
        results: List[Optional[R]] = [None] * len(items)

        def run(share: range) -> None:
            for index in share:
                results[index] = _guarded(fn, items[index])

        for future in [self._pool.submit(run, share) for share in shares]:
            future.result()
        return results


def _guarded(fn: Callable[[T], R], item: T) -> Optional[R]:
    try:
        return fn(item)
    except Exception:
        logger.exception("KV block copy %s failed", item)
        return None
