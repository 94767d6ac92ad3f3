"""Block pool: empty blocks first, prefix-cache hits, policy-ordered reuse of cached blocks;
invariants under random operations."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv.block_pool import BlockPool
from kv.prefix_hash import BlockHash
from kv.eviction import HotnessPolicy, HotnessTracker
from kv.prefix_hash import extend_block_hashes, hash_block


def _cache_and_free(pool, block, tokens):
    h = hash_block(None, tokens)
    pool.cache(block, h, tokens)
    pool.free([block])
    return h


def test_empty_blocks_go_before_cached_ones_and_cached_ones_in_lru_order():
    pool = BlockPool(5)
    a, b, c, d, e = pool.allocate(5)
    _cache_and_free(pool, c, [3])
    _cache_and_free(pool, a, [1])
    pool.free([e])  # empty: reused first although freed last
    _cache_and_free(pool, d, [4])
    taken = [blk.block_id for blk in pool.allocate(4)]
    assert taken == [e.block_id, c.block_id, a.block_id, d.block_id]
    assert pool.num_evicted == 3


def test_hotness_policy_keeps_the_block_many_requests_used():
    tracker = HotnessTracker(0.9)
    pool = BlockPool(3, policy=HotnessPolicy(tracker, hold_threshold=None))
    hot, cold, _ = pool.allocate(3)
    h_hot = _cache_and_free(pool, hot, [1])
    _cache_and_free(pool, cold, [2])
    for _ in range(5):  # five requests use the hot block; the cold one was used once, earlier
        tracker.tick()
        pool.policy.record_access(h_hot)
    (taken,) = pool.allocate(1)
    assert taken is cold
    assert pool.lookup(h_hot, [1]) is hot


def test_freed_cached_block_is_found_until_reused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache(block, h, [1, 2])
    pool.free([block])
    assert pool.lookup(h, [1, 2]) is block
    assert pool.lookup(h, [1, 3]) is None  # tokens are checked on a hit
    pool.touch(block)
    assert block.ref_count == 1 and not block.is_free
    pool.free([block])
    pool.allocate(2)  # reuses it: the hash is evicted
    assert pool.lookup(h, [1, 2]) is None
    assert pool.num_evicted == 1


def test_allocate_beyond_free_raises_and_can_allocate_says_so():
    pool = BlockPool(2)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(RuntimeError, match="3 blocks, 2 free"):
        pool.allocate(3)


def test_bad_pool_size_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_prefix_cache_off_never_hits():
    pool = BlockPool(2, enable_prefix_cache=False)
    (block,) = pool.allocate(1)
    h = hash_block(None, [5])
    pool.cache(block, h, [5])
    assert pool.lookup(h, [5]) is None


def test_block_hashes_chain_on_parent():
    hashes = extend_block_hashes([], [1, 2, 3, 4, 5], block_size=2)
    assert len(hashes) == 2  # only full blocks
    assert hashes[1] == hash_block(hashes[0], [3, 4])
    assert hash_block(None, [3, 4]) != hashes[1]
    assert extend_block_hashes(list(hashes), [1, 2, 3, 4, 5, 6], 2)[:2] == hashes


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free / cache / hit sequences against a simple model of the pool."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8)
        self.held = []  # references we hold, one entry per reference
        self.empty = {b.block_id for b in self.pool.blocks}  # free blocks without a hash
        self.free_order = []  # model of the LRU order of free cached blocks
        self.cached = {}  # hash -> (block, tokens)

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if not self.pool.can_allocate(n):
            return
        blocks = self.pool.allocate(n)
        num_empty = min(n, len(self.empty))
        assert {b.block_id for b in blocks[:num_empty]} <= self.empty  # empty blocks first
        self.empty -= {b.block_id for b in blocks[:num_empty]}
        evicted = [b.block_id for b in blocks[num_empty:]]
        assert evicted == self.free_order[:len(evicted)]  # then cached ones, LRU first
        self.free_order = self.free_order[len(evicted):]
        for b in blocks:
            self.cached = {h: v for h, v in self.cached.items() if v[0] is not b}
        self.held.extend(blocks)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free_one(self, i):
        block = self.held.pop(i % len(self.held))
        released = self.pool.free([block])
        assert released == ([block] if block.ref_count == 0 else [])
        if block.ref_count == 0:
            if block.block_hash is None:
                self.empty.add(block.block_id)
            else:
                self.free_order.append(block.block_id)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), tokens=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def cache(self, i, tokens):
        block = self.held[i % len(self.held)]
        h = hash_block(None, tokens)
        if block.block_hash is None and h not in self.cached:
            self.cached[h] = (block, tuple(tokens))
        self.pool.cache(block, h, tokens)

    @precondition(lambda self: self.cached)
    @rule(i=st.integers(0, 100))
    def hit(self, i):
        h = sorted(self.cached)[i % len(self.cached)]
        block, tokens = self.cached[h]
        assert self.pool.lookup(h, tokens) is block  # found again until reused
        if block.ref_count == 0:
            self.free_order.remove(block.block_id)
        self.pool.touch(block)
        self.held.append(block)

    @invariant()
    def free_xor_used(self):
        free_ids = self.empty | set(self.free_order)
        assert len(free_ids) == len(self.empty) + len(self.free_order)
        for block in self.pool.blocks:
            assert block.ref_count >= 0
            assert (block.block_id in free_ids) == (block.ref_count == 0)
            assert block.ref_count == sum(1 for b in self.held if b is block)
            if block.block_id in self.free_order:
                assert block.block_hash in self.pool.policy
        assert self.pool.num_free == len(free_ids)
        assert len(self.pool.policy) == len(self.free_order)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_a_hit_refreshes_a_hash_in_the_report():
    """The router sees the most recently *used* hashes: a hot prefix cached long ago and hit
    since stays in a short report (it aged out when the report went by insertion)."""
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.cache(block, BlockHash(100 + i), [i])
    pool.free(list(reversed(blocks)))
    assert pool.cached_hashes(2) == [104, 103]
    hot = pool.lookup(BlockHash(100), [0])
    pool.touch(hot)  # a hit on the oldest block
    assert pool.cached_hashes(2) == [100, 104]
