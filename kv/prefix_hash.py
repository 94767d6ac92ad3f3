"""Chained hashes over full blocks of token ids, the keys of the prefix cache.

A block's hash covers its own tokens and its parent's hash, so equal hashes mean equal prefixes up
to and including that block (modulo collisions, which the pool rules out by comparing the stored
tokens on a hit). The hash is stable across processes and runs (blake2b, not Python's ``hash``),
so a block hashed on one rank or in one run can be looked up in another.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import List, NewType, Optional, Sequence

BlockHash = NewType("BlockHash", int)


def hash_block(parent: Optional[BlockHash], token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained on ``parent`` (None for the first block)."""
    digest = hashlib.blake2b(digest_size=8)
    if parent is not None:
        digest.update(parent.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return BlockHash(int.from_bytes(digest.digest(), "little"))


def extend_block_hashes(
    block_hashes: List[BlockHash], token_ids: Sequence[int], block_size: int,
    num_tokens: Optional[int] = None,
) -> List[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids[:num_tokens]`` (all by default) not
    yet in ``block_hashes``.

    Costs O(new full blocks): a request's hashes are extended as its tokens grow, never redone.
    """
    num_full = (len(token_ids) if num_tokens is None else num_tokens) // block_size
    for index in range(len(block_hashes), num_full):
        parent = block_hashes[-1] if block_hashes else None
        start = index * block_size
        block_hashes.append(hash_block(parent, token_ids[start:start + block_size]))
    return block_hashes
