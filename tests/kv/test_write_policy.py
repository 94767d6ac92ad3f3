"""The write policy and the spill pacer: when a cached block goes down a tier, and how fast.

Pure bookkeeping (no bytes move): the pacer with a fake clock, then ``KVTiers`` under a block
manager stepped by hand, checking which ``Spill`` / ``WriteDisk`` ops each policy issues."""

import pytest

from kv.eviction import LRUPolicy
from kv.kv_manager import KVCacheManager
from kv.prefix_hash import hash_block
from kv.tiers.index import TierIndex
from kv.tiers.ops import OpStatus, Spill, TierOpResults, WriteDisk
from kv.tiers.hierarchy import KVTiers
from kv.tiers.write_policy import HitCounter, SpillPacer, check_write_policy

BLOCK = 2


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_pacer_without_a_rate_takes_everything_at_once():
    pacer = SpillPacer(item_bytes=1000, gbps=None, max_pending=8)
    for key in range(5):
        pacer.offer(key, key)
    assert pacer.take(lambda item: True) == [0, 1, 2, 3, 4]
    assert pacer.num_pending == 0 and pacer.num_dropped == 0


def test_pacer_issues_what_the_bucket_pays_for_and_refills_with_time():
    clock = Clock()
    # 1 GB/s, a burst of 0.25 s = 250 MB: 2 items of 100 MB, then 1 per 0.1 s
    pacer = SpillPacer(item_bytes=100_000_000, gbps=1.0, max_pending=16, clock=clock)
    for key in range(6):
        pacer.offer(key, key)
    assert pacer.take(lambda item: True) == [0, 1]
    assert pacer.take(lambda item: True) == []  # no time has passed
    clock.now = 0.1
    assert pacer.take(lambda item: True) == [2]
    clock.now = 10.0  # refills at most one burst
    assert pacer.take(lambda item: True) == [3, 4]
    assert pacer.num_pending == 1


def test_pacer_says_how_long_until_it_pays_for_the_next_item():
    clock = Clock()
    pacer = SpillPacer(item_bytes=100_000_000, gbps=1.0, max_pending=16, clock=clock)
    assert pacer.wait_s() == 0.0  # nothing queued
    for key in range(3):
        pacer.offer(key, key)
    assert pacer.wait_s() == 0.0  # the burst pays for two now
    assert pacer.take(lambda item: True) == [0, 1]
    assert pacer.wait_s() == pytest.approx(0.05)  # 50 MB left of the burst: 50 ms to 100 MB
    clock.now = 0.05
    assert pacer.wait_s() == pytest.approx(0.0)
    assert SpillPacer(1, None, 4).wait_s() == 0.0


def test_pacer_drops_stale_discarded_and_overflowing_items():
    pacer = SpillPacer(item_bytes=1, gbps=None, max_pending=3)
    for key in range(5):  # 0 and 1 fall off the front
        pacer.offer(key, key)
    assert pacer.num_dropped == 2
    assert pacer.discard(3) and not pacer.discard(3)
    assert pacer.take(lambda item: item != 2) == [4]  # 2 is no longer worth spilling
    assert pacer.num_dropped == 4


def test_hit_counter_forgets_the_least_recently_hit_beyond_capacity():
    hits = HitCounter(capacity=2)
    for key in ("a", "b", "a", "c"):
        hits.hit(key)
    assert (hits["a"], hits["b"], hits["c"]) == (2, 0, 1) and len(hits) == 2


@pytest.mark.parametrize("args, option", [
    (("write_around", 1, None), "--kv-write-policy"),
    (("write_through_selective", 0, None), "--kv-write-threshold"),
    (("write_back", 1, 0.0), "--kv-spill-gbps"),
    (("write_back", 1, -2.0), "--kv-spill-gbps"),
])
def test_bad_write_policy_settings_are_refused_by_name(args, option):
    with pytest.raises(ValueError, match=option):
        check_write_policy(*args)


class Tiers:
    """A device pool of ``num_blocks`` blocks over a host tier (and a disk tier), LRU."""

    def __init__(self, policy, num_blocks=4, host_blocks=8, disk_blocks=None, threshold=1,
                 spill_gbps=None, block_bytes=1):
        self.kv = KVCacheManager(num_blocks, BLOCK)
        disk = TierIndex("disk", disk_blocks, LRUPolicy()) if disk_blocks else None
        self.tiers = KVTiers(self.kv.pool, BLOCK, TierIndex("host", host_blocks, LRUPolicy()),
                             disk, policy, threshold, spill_gbps, block_bytes)
        self.kv.tiers = self.tiers
        self.num_requests = 0

    def run(self, tokens):
        """One request over ``tokens``: look up its prefix, allocate, cache, release."""
        key = self.num_requests
        self.num_requests += 1
        hashes = _hashes(tokens)
        prefix = self.kv.find_cached_prefix(tokens, hashes)
        hit = prefix.num_tokens + BLOCK * len(self.tiers.find_lower(
            tokens, hashes, len(prefix.blocks), (len(tokens) - 1) // BLOCK))
        self.kv.count_prefix_query(len(tokens), prefix, hit, hashes)
        self.kv.allocate(key, len(tokens), prefix)
        self.kv.cache_full_blocks(key, tokens, hashes, len(tokens))
        self.kv.free(key)
        return hashes

    def ops(self):
        """Take the issued ops and let every one of them succeed."""
        ops = self.tiers.take_ops()
        first = self.tiers.num_committed
        self.tiers.commit(TierOpResults(first, (OpStatus.OK,) * (self.tiers.num_issued - first)))
        return ops


def _hashes(tokens):
    hashes, parent = [], None
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hash_block(parent, tokens[start:start + BLOCK])
        hashes.append(parent)
    return hashes


def _spilled(ops):
    return [op.tag for op in ops if isinstance(op, Spill)]


def test_write_through_spills_every_released_block():
    t = Tiers("write_through")
    hashes = t.run([1, 2, 3, 4])
    assert _spilled(t.ops()) == list(reversed(hashes))  # released last block first


def test_selective_spills_only_blocks_hit_often_enough():
    t = Tiers("write_through_selective", threshold=2)
    hashes = t.run([1, 2, 3, 4])
    assert _spilled(t.ops()) == []  # never hit: one-off blocks stay on the device
    t.run([1, 2, 3, 4, 5])
    assert _spilled(t.ops()) == []  # hit once
    t.run([1, 2, 3, 4, 6])
    assert sorted(_spilled(t.ops())) == sorted(hashes)  # hit twice
    assert t.tiers.hits[hashes[0]] == 2


def test_selective_sends_to_disk_only_host_victims_hit_often_enough():
    t = Tiers("write_through_selective", num_blocks=4, host_blocks=2, disk_blocks=8)
    hot = t.run([1, 2, 3, 4])
    t.run([1, 2, 3, 4, 9])  # hot's two blocks hit once
    assert sorted(_spilled(t.ops())) == sorted(hot)
    cold = t.run([7, 8, 5, 6])
    t.run([7, 8, 5, 6, 9])  # the cold blocks hit once too, and evict hot's from host
    ops = t.ops()
    assert sorted(op.tag for op in ops if isinstance(op, WriteDisk)) == sorted(hot)
    assert sorted(_spilled(ops)) == sorted(cold)


def test_write_back_spills_a_block_only_when_the_device_evicts_it():
    t = Tiers("write_back", num_blocks=2)
    first = t.run([1, 2, 3, 4])
    assert _spilled(t.ops()) == []
    t.run([5, 6, 7, 8])  # takes both device blocks: first's are evicted
    assert sorted(_spilled(t.ops())) == sorted(first)
    assert t.tiers.stats.num_written_back == 2
    assert all(h in t.tiers.host.entries for h in first)
    # a block already on host is not copied again when evicted again
    t.run([1, 2, 3, 4])  # misses on the device (evicted) but is not restored here
    t.run([5, 6, 7, 8])
    assert [tag for tag in _spilled(t.ops()) if tag in first] == []


def test_paced_spills_wait_for_bandwidth_and_are_dropped_when_evicted_first():
    # a bound so low that the bucket holds one block: one spill now, the rest queued
    t = Tiers("write_through", num_blocks=4, spill_gbps=1e-9, block_bytes=1000)
    t.run([1, 2, 3, 4, 5, 6, 7, 8])
    assert len(_spilled(t.ops())) == 1
    assert t.tiers.pacer.num_pending == 3 and t.tiers.has_outstanding
    t.run([11, 12, 13, 14, 15, 16, 17, 18])  # reuses every device block, then queues its own
    assert t.tiers.pacer.num_dropped == 3 and t.tiers.pacer.num_pending == 4
    assert t.tiers.usage()["spills_dropped_total"] == 3


def test_write_back_evictions_never_evict_the_blocks_a_restore_is_about_to_read():
    """Allocating a restoring request's device blocks evicts device blocks; write-back spills
    them to host, which evicts host blocks: never the ones the request found there."""
    t = Tiers("write_back", num_blocks=2, host_blocks=2)
    first = t.run([1, 2, 3, 4])
    t.run([5, 6, 7, 8])  # evicts first's blocks to host: host full
    t.ops()
    tokens = [1, 2, 3, 4, 9]
    hashes = _hashes(tokens)
    hits = t.tiers.find_lower(tokens, hashes, 0, 2)
    assert [h.block_hash for h in hits] == first[:2] and {h.tier for h in hits} == {"host"}
    t.tiers.hold(hits)
    blocks = t.kv.pool.allocate(2)  # evicts the second request's blocks: host must take them
    chain = t.tiers.restore(hits, blocks)  # raised KeyError when host had evicted a hit
    assert len(chain.hashes) == 2
    assert all(h in t.tiers.host.entries for h in first[:2])
    assert t.tiers.stats.num_spills_skipped == 2  # host held only the hits: nowhere to go
