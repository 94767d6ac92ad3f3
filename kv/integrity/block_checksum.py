"""Which checksum a rank's KV blocks carry, and where it is computed: the copier's strategy.

=====================  ======================  ============================================
pool                   on the transfer path    every host-side verification (disk reads)
=====================  ======================  ============================================
CPU tensors            xxh3, copier threads    xxh3
CUDA, CuPy works       mix64, CuPy kernel      mix64, numpy reference (bit-identical)
CUDA, no CuPy          xxh3 on the host        xxh3
=====================  ======================  ============================================

A block's checksum is made by one function and always checked by the same one: the strategy's
``name`` goes into the disk index's identity, so a disk tier written under one function is not
trusted (a cold cache, one warning) by an engine that chose the other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from kv.integrity.checksum import (MIX64_WORD_BYTES, DeviceHashUnavailable, block_checksum,
                                   mix64_checksum, pool_rows)
from kv.kv_cache import KVCache

logger = logging.getLogger(__name__)


class DeviceBlockHasher(Protocol):
    """Hashes whole blocks where they lie in the device pool (mix64, one launch per batch)."""

    def hash_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """mix64 of each block, ``[len(block_ids)]`` int64 (the uint64 bits) on the pool's
        device, queued on the current stream; the caller synchronizes before reading it."""


@dataclass(frozen=True)
class BlockChecksum:
    """A checksum function and where it runs.

    ``host(data) -> int``: the checksum of a block's contiguous bytes on the host (every
    host-side check uses it). ``device``: when set, the copier hashes blocks on the device
    instead, with the same function, before a spill's copy and after a restore's copy.
    """

    name: str
    host: Callable[[object], int]
    device: Optional[DeviceBlockHasher] = None


XXH3 = BlockChecksum("xxh3", block_checksum)


class ReferenceBlockHasher:
    """``DeviceBlockHasher`` in numpy over a CPU pool: what the CuPy kernel computes, so the
    device path of the copier (hash before a spill, copy then verify on a restore) runs and is
    tested on CPU. Synchronous."""

    def __init__(self, kv_cache: KVCache) -> None:
        if kv_cache.data.is_cuda:
            raise ValueError("ReferenceBlockHasher reads the pool with numpy: CPU tensors only")
        rows, self._row_bytes = pool_rows(kv_cache)
        self._rows = rows.numpy()

    def hash_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        rb = self._row_bytes
        sums = [mix64_checksum(self._rows[:, b * rb:(b + 1) * rb]) for b in block_ids]
        return torch.from_numpy(np.array(sums, dtype=np.uint64).view(np.int64))


def mix64_strategy(hasher: DeviceBlockHasher) -> BlockChecksum:
    """mix64 hashed on the device by ``hasher``, verified on the host by the numpy reference."""
    return BlockChecksum("mix64", mix64_checksum, hasher)


def choose_block_checksum(kv_cache: KVCache) -> BlockChecksum:
    """The strategy for this pool (see the module table), logged in one line."""
    def load() -> DeviceBlockHasher:
        from kv.integrity.cupy_checksum import load_cupy_hasher  # CuPy is optional: imported lazily
        return load_cupy_hasher(kv_cache)

    _, row_bytes = pool_rows(kv_cache)
    checksum, why = select_checksum(kv_cache.data.is_cuda, row_bytes, load)
    logger.info("KV block checksums: %s (%s)", checksum.name, why)
    return checksum


def select_checksum(is_cuda: bool, row_bytes: int,
                    load_device_hasher: Callable[[], DeviceBlockHasher]
                    ) -> Tuple[BlockChecksum, str]:
    """The strategy and why: a pure decision given how to load the device hasher (which raises
    ``DeviceHashUnavailable`` with the reason when it cannot)."""
    if not is_cuda:
        return XXH3, "CPU pool: hashed by the copier threads as they copy"
    if row_bytes % MIX64_WORD_BYTES:
        return XXH3, (f"on the host: a block row is {row_bytes} bytes, not a multiple of 8, "
                      f"which the device kernel needs")
    try:
        hasher = load_device_hasher()
    except DeviceHashUnavailable as exc:
        return XXH3, f"on the host: {exc}"
    return mix64_strategy(hasher), "on the device by a CuPy kernel; numpy reference on the host"


def index_identity(identity: str, checksum_name: str) -> str:
    """The disk index's identity: checksums made by another function mean other bytes. xxh3
    keeps the plain identity, so indexes written before mix64 existed stay valid."""
    return identity if checksum_name == "xxh3" else f"{identity}#checksum={checksum_name}"
