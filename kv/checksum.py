"""Checksums of KV block bytes written to a lower tier (xxh3, 64 bits: tens of GB/s per core)."""

from __future__ import annotations

import xxhash


def block_checksum(data: memoryview) -> int:
    """64-bit checksum of a block's bytes (any contiguous buffer)."""
    return xxhash.xxh3_64_intdigest(data)
