"""Checksums of KV block bytes written to a lower tier: xxh3, 64 bits (about 9 GB/s per core from
memory here, about 48 GB/s on bytes already in cache, which is why blocks are hashed right after
they are copied)."""

from __future__ import annotations

import xxhash


def block_checksum(data) -> int:
    """64-bit checksum of a block's bytes (any contiguous buffer)."""
    return xxhash.xxh3_64_intdigest(data)
