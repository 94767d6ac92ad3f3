"""Checksums of KV block bytes written to a lower tier. Two functions, both 64 bits:

- ``block_checksum``: xxh3, several times faster on bytes already in cache, which is why CPU
  blocks are hashed right after they are copied.
- ``mix64_checksum``: what the device computes on CUDA (``kv/integrity/cupy_checksum.py``) so that host CPUs
  do not hash on the device's transfer path; this is its numpy reference, bit-identical to the
  kernel, and the function every host-side verification of a device-hashed block uses.

mix64 of a block of ``n`` 8-byte little-endian words ``w[0..n)`` is::

    sum over i of splitmix64(w[i] + (i + 1) * 0x9E3779B97F4A7C15)   (mod 2**64)

Each word is mixed with its position, and the terms are added with wrapping addition, which is
associative and commutative: a parallel kernel may add them in any order and still give exactly
these bits. What it guarantees: ``splitmix64`` is a bijection and ``w -> w + c`` is one, so a
change to any one word (a flipped bit anywhere, the last byte included) always changes the sum.
What it does not guarantee, unlike xxh3: changes to several words are caught only with
probability about ``1 - 2**-64`` if the mixer behaves like a random function (swapped words or
rows included, since each term depends on its position), not by construction; the terms are
independent, so corruptions can be made to cancel on purpose (it is a checksum against faults,
not against an adversary; neither is xxh3); and it needs a byte size that is a multiple of 8.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
import xxhash

from kv.kv_cache import KVCache

MIX64_WORD_BYTES = 8
_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_CHUNK_WORDS = 1 << 15  # 256 KiB per numpy pass: the temporaries stay in cache
# (i + 1) * golden for i in one chunk; chunk k adds k * CHUNK * golden.
_STEPS = (np.arange(1, _CHUNK_WORDS + 1, dtype=np.uint64) * _GOLDEN)


def block_checksum(data) -> int:
    """xxh3-64 of a block's bytes (any contiguous buffer)."""
    return xxhash.xxh3_64_intdigest(data)


def mix64_checksum(data) -> int:
    """mix64 (see the module docstring) of a block's bytes, in numpy on the host.

    ``data``: anything numpy reads as bytes: a contiguous buffer, or a 2-D uint8 array of rows
    (``[rows, row_bytes]``, each row contiguous, rows anywhere) hashed as the rows laid back to
    back, which is how a device block's strided rows are hashed in place. Raises ValueError when
    a row's byte size is not a multiple of 8. Cost: O(bytes), several numpy passes over 256 KiB
    chunks (the numpy calls release the GIL, so threads add up).
    """
    array = np.asarray(data) if not isinstance(data, (bytes, bytearray, memoryview)) else (
        np.frombuffer(data, dtype=np.uint8))
    rows = array.reshape(1, -1) if array.ndim == 1 else array
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError(f"mix64_checksum: expected bytes or a 2-D uint8 array of rows, got "
                         f"{rows.dtype} of shape {rows.shape}")
    if rows.shape[1] % MIX64_WORD_BYTES:
        raise ValueError(f"mix64_checksum: rows of {rows.shape[1]} bytes; mix64 hashes 8-byte "
                         f"words, so a row's size must be a multiple of 8 (use xxh3 instead)")
    total = 0
    position = 0
    for row in rows:
        words = np.ascontiguousarray(row).view("<u8")
        for start in range(0, len(words), _CHUNK_WORDS):
            chunk = words[start:start + _CHUNK_WORDS]
            total += int(_mixed_sum(chunk, position + start))
        position += len(words)
    return total & _MASK


def _mixed_sum(words: np.ndarray, first: int) -> np.uint64:
    """Sum of splitmix64(word + (first + i + 1) * golden) over ``words`` (wrapping)."""
    offset = np.uint64((first * int(_GOLDEN)) & _MASK)
    x = words + _STEPS[:len(words)]
    x += offset
    x ^= x >> np.uint64(30)
    x *= _MUL1
    x ^= x >> np.uint64(27)
    x *= _MUL2
    x ^= x >> np.uint64(31)
    return np.add.reduce(x, dtype=np.uint64)


class DeviceHashUnavailable(Exception):
    """Why blocks cannot be hashed on this device (the message says what to install or fix)."""


def pool_rows(kv_cache: KVCache) -> Tuple[torch.Tensor, int]:
    """The pool as bytes ``[2 * num_layers, blocks * row_bytes]`` and ``row_bytes``: block ``b``
    is columns ``[b * row_bytes, (b + 1) * row_bytes)`` of every row (a view, no copy). ``blocks``
    counts a scratch block too where the pool has one, so ``row_bytes`` comes from the spec."""
    spec = kv_cache.spec
    rows = kv_cache.data.view(2 * spec.num_layers, -1).view(torch.uint8)
    row_bytes = (spec.block_size * spec.num_kv_heads * spec.head_dim
                 * kv_cache.data.element_size())
    return rows, row_bytes
