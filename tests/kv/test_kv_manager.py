"""Block tables on top of the pool: prefix reuse, growth, freeing, waste accounting."""

from kv.kv_manager import CachedPrefix, KVCacheManager
from kv.prefix_hash import extend_block_hashes

EMPTY = CachedPrefix([], 0)


def hashes(tokens, block_size=4):
    return extend_block_hashes([], tokens, block_size)


def test_second_request_reuses_cached_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    kv.allocate("a", 10, EMPTY)
    kv.cache_full_blocks("a", tokens, hashes(tokens), num_computed=10)
    prefix = kv.find_cached_prefix(tokens, hashes(tokens))
    assert prefix.num_tokens == 8  # two full blocks; the partial third is not cached
    same_len = kv.find_cached_prefix(tokens[:8], hashes(tokens[:8]))
    assert same_len.num_tokens == 4  # one token must stay to compute the logits
    ids = kv.allocate("b", 10, prefix)
    assert ids[:2] == kv.block_ids("a")[:2] and ids[2] != kv.block_ids("a")[2]
    assert kv.pool.num_used == 4


def test_cached_blocks_survive_free_and_count_as_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    tokens = list(range(8))
    kv.allocate("a", 8, EMPTY)
    kv.cache_full_blocks("a", tokens, hashes(tokens), 8)
    kv.free("a")
    prefix = kv.find_cached_prefix(tokens + [99], hashes(tokens + [99]))
    assert prefix.num_tokens == 8
    # Taking 2 cached free blocks plus 1 fresh one uses all 3; a 4th would not fit.
    assert kv.num_blocks_needed("b", 9, prefix) == 3
    assert kv.can_allocate("b", 9, prefix) and not kv.can_allocate("b", 13, prefix)


def test_waste_counts_only_unfilled_slots_of_allocated_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 5, EMPTY)  # 2 blocks, 3 slots empty
    kv.allocate("b", 8, EMPTY)  # 2 blocks, full
    usage = kv.usage({"a": 5, "b": 8})
    assert usage.num_allocated_slots == 16 and usage.num_filled_slots == 13
    assert abs(usage.waste_frac - 3 / 16) < 1e-9
    assert usage.num_used_blocks == 4 and usage.usage == 0.5
