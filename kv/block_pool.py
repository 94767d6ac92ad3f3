"""A fixed pool of KV blocks with O(1) allocate, free and prefix-cache hit.

A block is in use (``ref_count > 0``) or free. Free blocks are of two kinds: empty ones (no hash),
kept on a stack and handed out first, and cached ones, which keep their contents and hash until
they are allocated again, so a later request with the same prefix finds them by hash and takes them
back. Which cached block is reused first is the eviction policy's choice (``kv/eviction.py``: LRU,
or hotness)::

    allocate():  empty stack  --(empty)-->  policy.victim()  (evicts its hash)
    free():      ref 0, no hash -> empty stack; ref 0, hashed -> policy.insert(hash)
    touch():     a hit on a free cached block -> policy.remove(hash)

Invariants (checked by the property tests): a block is either free (``ref_count == 0``, on the
empty stack or in the policy) or in use, never both; ref counts never go negative; a hash maps to
at most one block and that block's stored tokens are the ones the hash was made of.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from kv.eviction import EvictionPolicy, LRUPolicy
from kv.prefix_hash import BlockHash
from kv.types import BlockId


@dataclass(eq=False)
class Block:
    """One block of ``block_size`` KV slots."""

    block_id: BlockId
    ref_count: int = 0
    block_hash: Optional[BlockHash] = None
    token_ids: Tuple[int, ...] = ()

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0


class BlockPool:
    """Blocks, their free sets and the prefix cache (hash -> block) of one KV pool.

    Costs: ``allocate``, ``free``, ``touch`` and ``lookup`` are O(1) per block with LRU and
    O(log n) with the hotness policy.
    """

    def __init__(self, num_blocks: int, enable_prefix_cache: bool = True,
                 policy: Optional[EvictionPolicy] = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks: List[Block] = [Block(BlockId(i)) for i in range(num_blocks)]
        self._empty: List[Block] = list(reversed(self.blocks))  # pop() hands out low ids first
        self.policy = policy if policy is not None else LRUPolicy()
        self.enable_prefix_cache = enable_prefix_cache
        # By recency of use (a hit moves a hash to the end), so a report of the latest hashes
        # keeps a hot prefix however long ago it was first cached.
        self._cached: "OrderedDict[BlockHash, Block]" = OrderedDict()
        self.is_cached: Callable[[BlockHash], bool] = self._cached.__contains__  # C-level
        self.num_evicted = 0
        self.num_held_evicted = 0  # hot (held) cached blocks, evicted as a last resort
        # Called with a cached block about to be reused, before it loses its hash (the tiers
        # below hook write-back here).
        self.on_evict: Optional[Callable[[Block], None]] = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self.policy)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> List[Block]:
        """Take ``num_blocks`` blocks: empty ones first, then the policy's victims (evicted)."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free} free")
        taken = []
        for _ in range(num_blocks):
            block = self._empty.pop() if self._empty else self._take_victim()
            block.ref_count = 1
            taken.append(block)
        return taken

    def free(self, blocks: Sequence[Block]) -> List[Block]:
        """Drop one reference from each block; returns the blocks that became free.

        Callers pass a request's blocks in reverse order so that its last (least shareable)
        blocks are evicted before its first ones.
        """
        released = []
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._empty.append(block)
                else:
                    self.policy.insert(block.block_hash)
                released.append(block)
        return released

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Optional[Block]:
        """The cached block with this hash whose tokens are ``token_ids``, or None."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, block: Block) -> None:
        """Take a reference on a cached block found by ``lookup`` (it stops being evictable)."""
        if block.ref_count == 0:
            assert block.block_hash is not None, f"touched free block {block.block_id} is not cached"
            self.policy.remove(block.block_hash)
        if block.block_hash is not None:
            self._cached.move_to_end(block.block_hash)
        block.ref_count += 1

    def cache(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Record that the in-use ``block`` holds the full block ``token_ids`` under ``block_hash``."""
        if not self.enable_prefix_cache or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # Another block holds the same prefix; this one stays private and unhashed.
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def cached_hashes(self, limit: int) -> List[BlockHash]:
        """Up to ``limit`` hashes in the prefix cache, most recently cached or hit first.
        O(limit)."""
        return list(itertools.islice(reversed(self._cached), limit))

    def _take_victim(self) -> Block:
        block_hash = self.policy.victim()
        assert block_hash is not None, "no free block although num_free said so"
        if self.policy.is_held(block_hash):
            self.num_held_evicted += 1
        self.policy.remove(block_hash)
        block = self._cached[block_hash]
        if self.on_evict is not None:
            self.on_evict(block)  # still holds its hash and tokens
        del self._cached[block_hash]
        block.block_hash = None
        block.token_ids = ()
        self.num_evicted += 1
        return block
