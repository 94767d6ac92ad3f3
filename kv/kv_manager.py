"""Block tables of the requests in flight, on top of one ``BlockPool``: what the scheduler calls.

A request's block table is the list of blocks holding its tokens in order. Full blocks are
registered in the prefix cache under their chained hash once their K/V has been computed, so a
later request with the same prefix takes them (``find_cached_prefix``) instead of recomputing.
The manager keys everything by an opaque request key; it knows nothing about requests otherwise.

With a sliding window on every layer, a request's oldest blocks leave the window and are freed
while it runs (``free_leading_blocks``). They keep their places in its table, so position ``p``
stays in block ``p // block_size``; those leading entries are stale (another request may hold
the block now) and are never freed, cached or read for this request again.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import filterfalse, islice
from typing import Dict, Hashable, Iterator, List, Optional, Sequence

from kv.block_pool import Block, BlockPool
from kv.eviction import EvictionPolicy, HotnessTracker
from kv.prefix_hash import BlockHash
from kv.tiers.hierarchy import KVTiers
from kv.types import BlockId


@dataclass(frozen=True)
class CachedPrefix:
    """Blocks found in the prefix cache for the start of a request, not yet referenced."""

    blocks: List[Block]
    num_tokens: int


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the pool for the scheduler and the router."""

    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    block_size: int
    num_allocated_slots: int
    num_filled_slots: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def waste_frac(self) -> float:
        """Share of allocated slots holding no token (partly filled last blocks)."""
        if self.num_allocated_slots == 0:
            return 0.0
        return 1.0 - self.num_filled_slots / self.num_allocated_slots


class KVCacheManager:
    """Allocates, caches and frees the blocks of requests. O(blocks touched) per call."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 policy: Optional[EvictionPolicy] = None,
                 tracker: Optional[HotnessTracker] = None) -> None:
        """``policy`` picks which cached free block is reused first (LRU by default);
        ``tracker`` is the hotness clock shared with the lower tiers, when hotness is in use."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_cache, policy)
        self.tracker = tracker
        self.tiers: Optional[KVTiers] = None  # host/disk tiers below the pool, when configured
        self._tables: Dict[Hashable, List[Block]] = {}
        self._num_cached: Dict[Hashable, int] = {}  # leading blocks already registered
        self._num_freed: Dict[Hashable, int] = {}  # leading blocks freed: stale table entries
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found, in any tier
        self.num_device_hits = 0  # of which found in this pool

    @property
    def enable_prefix_cache(self) -> bool:
        return self.pool.enable_prefix_cache

    def find_cached_prefix(
        self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> CachedPrefix:
        """The longest run of cached leading blocks, leaving at least one token to compute."""
        blocks = list(self._cached_blocks(token_ids, block_hashes, 0, len(block_hashes)))
        return CachedPrefix(blocks, len(blocks) * self.block_size)

    def count_cached_blocks(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                            start: int, limit: int) -> int:
        """``find_cached_prefix``'s length in blocks, given that the first ``start`` blocks are
        cached, looking at no more than ``limit`` blocks past them (so at most ``start + limit``:
        a walk a caller continues later, see ``workers.waiting_demand``)."""
        return start + sum(1 for _ in self._cached_blocks(token_ids, block_hashes, start, limit))

    def _cached_blocks(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                       start: int, limit: int) -> Iterator[Block]:
        """The cached blocks from block ``start`` on, up to the first miss, ``limit`` blocks or
        the last block with a token after it."""
        if not self.enable_prefix_cache:
            return
        end = min(start + limit, (len(token_ids) - 1) // self.block_size, len(block_hashes))
        size = self.block_size
        for index in range(start, end):
            block = self.pool.lookup(block_hashes[index], token_ids[index * size:(index + 1) * size])
            if block is None:
                return
            yield block

    def count_prefix_query(self, num_tokens: int, prefix: CachedPrefix, num_hit_tokens: int,
                           block_hashes: Sequence[BlockHash]) -> None:
        """Count an admitted request's lookup (``prefix`` found here, ``num_hit_tokens`` in any
        tier) and tell the eviction policies that this request uses the blocks ``block_hashes``."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens
        self.num_device_hits += prefix.num_tokens
        if self.tracker is not None:
            self.tracker.tick()
        for block_hash in block_hashes:
            self.pool.policy.record_access(block_hash)
            if self.tiers is not None:
                self.tiers.record_access(block_hash)
        if self.tiers is not None:
            self.tiers.record_hits(block_hashes[:num_hit_tokens // self.block_size])

    def num_blocks_needed(self, key: Hashable, num_tokens: int, prefix: CachedPrefix) -> int:
        """Blocks to allocate so ``key`` holds ``num_tokens`` tokens, given its cached prefix."""
        held = len(self._tables.get(key, ())) or len(prefix.blocks)
        needed = (num_tokens + self.block_size - 1) // self.block_size - held
        # Cached blocks sitting on the free list are free capacity that taking them consumes.
        reclaimed = sum(1 for block in prefix.blocks if block.ref_count == 0)
        return max(needed, 0) + (reclaimed if key not in self._tables else 0)

    def can_allocate(self, key: Hashable, num_tokens: int, prefix: CachedPrefix) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(key, num_tokens, prefix))

    def allocate(self, key: Hashable, num_tokens: int, prefix: CachedPrefix) -> List[BlockId]:
        """Grow ``key``'s table to hold ``num_tokens`` tokens; returns the new block ids.

        On the first call the cached prefix's blocks are referenced and head the table.
        Raises ``RuntimeError`` if the pool lacks blocks: call ``can_allocate`` first.
        """
        table = self._tables.get(key)
        new_ids: List[BlockId] = []
        if table is None:
            for block in prefix.blocks:
                self.pool.touch(block)
            table = self._tables[key] = list(prefix.blocks)
            self._num_cached[key] = len(prefix.blocks)
            new_ids = [block.block_id for block in table]
        missing = (num_tokens + self.block_size - 1) // self.block_size - len(table)
        if missing > 0:
            fresh = self.pool.allocate(missing)
            table.extend(fresh)
            new_ids.extend(block.block_id for block in fresh)
        return new_ids

    def cache_full_blocks(
        self, key: Hashable, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
        num_computed: int,
    ) -> None:
        """Register ``key``'s blocks that are full and computed in the prefix cache."""
        table = self._tables[key]
        num_full = min(num_computed // self.block_size, len(block_hashes), len(table))
        for index in range(self._num_cached[key], num_full):
            start = index * self.block_size
            self.pool.cache(table[index], block_hashes[index],
                            token_ids[start:start + self.block_size])
        self._num_cached[key] = max(self._num_cached[key], num_full)

    def block_ids(self, key: Hashable, start: int = 0, stop: Optional[int] = None
                  ) -> List[BlockId]:
        """Ids of ``key``'s blocks ``start..stop-1`` (all by default). O(blocks returned)."""
        return [block.block_id for block in self._tables.get(key, [])[start:stop]]

    def free(self, key: Hashable) -> None:
        """Release ``key``'s blocks, last block first so shared prefixes outlive tails."""
        table = self._tables.pop(key, None)
        self._num_cached.pop(key, None)
        num_freed = self._num_freed.pop(key, 0)
        if table:
            self._release(list(reversed(table[num_freed:])))

    def free_leading_blocks(self, key: Hashable, num_blocks: int) -> None:
        """Free ``key``'s first ``num_blocks`` blocks, which no query of it will read again (they
        left the sliding window); blocks freed by an earlier call are skipped. The entries stay
        in the table. A block shared with another request (a cached prefix) only loses this
        request's reference. Raises ``ValueError`` past the table's end. O(blocks freed)."""
        table = self._tables[key]
        if num_blocks > len(table):
            raise ValueError(f"cannot free {num_blocks} leading blocks of {key!r}: its table "
                             f"holds {len(table)} blocks")
        done = self._num_freed.get(key, 0)
        if num_blocks <= done:
            return
        self._num_freed[key] = num_blocks
        # A block freed before it was registered must never be registered later: it may
        # hold another request's tokens by then.
        self._num_cached[key] = max(self._num_cached[key], num_blocks)
        self._release(list(reversed(table[done:num_blocks])))

    def _release(self, blocks: List[Block]) -> None:
        released = self.pool.free(blocks)
        if self.tiers is not None:
            self.tiers.on_release(released)

    def cached_hashes(self, limit: int) -> List[BlockHash]:
        """Up to ``limit`` block hashes a prefix lookup finds without recomputing: this pool's
        (most recently cached or hit first), then those only the host tier holds (most recently
        written there first), which a lookup restores by a copy. The disk tier's are left out: a
        read from disk can take longer than computing the tokens again. O(limit): the host
        entries passed over are the pool's own, fewer than ``limit`` when the host is read."""
        hashes = self.pool.cached_hashes(limit)
        if self.tiers is not None and len(hashes) < limit:
            # C-level iteration: this runs after every engine step.
            host_only = filterfalse(self.pool.is_cached, self.tiers.host.recent_hashes())
            hashes += islice(host_only, limit - len(hashes))
        return hashes

    def blocks(self, key: Hashable) -> List[Block]:
        """``key``'s table; after ``free_leading_blocks`` its first entries are stale."""
        return list(self._tables.get(key, ()))

    def usage(self, filled_slots: Dict[Hashable, int]) -> KVUsage:
        """Pool snapshot; ``filled_slots`` gives the tokens each request has written."""
        allocated = self.pool.num_used * self.block_size
        waste = sum(len(self._tables[k]) * self.block_size - n
                    for k, n in filled_slots.items() if k in self._tables)
        return KVUsage(
            num_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used,
            num_cached_blocks=self.pool.num_cached,
            block_size=self.block_size,
            num_allocated_slots=allocated,
            num_filled_slots=allocated - waste,
        )
