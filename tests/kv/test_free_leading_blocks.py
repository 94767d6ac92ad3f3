"""Freeing the blocks that left a sliding window: back to the pool, their places kept in the
table, and a cached prefix block shared with another request stays with that request."""

import pytest

from kv.kv_manager import CachedPrefix, KVCacheManager
from kv.prefix_hash import extend_block_hashes

EMPTY = CachedPrefix([], 0)


def hashes(tokens, block_size=4):
    return extend_block_hashes([], tokens, block_size)


def test_freed_leading_blocks_go_back_to_the_pool_and_keep_their_places():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 20, EMPTY)
    ids = kv.block_ids("a")
    kv.free_leading_blocks("a", 3)
    assert kv.pool.num_used == 2
    assert kv.usage({"a": 20}).num_used_blocks == 2
    assert kv.block_ids("a") == ids  # positions still map to the same table index
    assert kv.num_blocks_needed("a", 24, EMPTY) == 1  # block 5 for positions 20..23
    new = kv.allocate("a", 24, EMPTY)
    assert len(new) == 1 and kv.block_ids("a")[:5] == ids
    kv.free_leading_blocks("a", 2)  # fewer than already freed: nothing happens
    assert kv.pool.num_used == 3
    kv.free("a")  # frees only what it still holds
    assert kv.pool.num_used == 0 and kv.pool.num_free == 8


def test_a_shared_prefix_block_stays_with_the_request_still_using_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    kv.allocate("a", 10, EMPTY)
    kv.cache_full_blocks("a", tokens, hashes(tokens), 10)
    prefix = kv.find_cached_prefix(tokens, hashes(tokens))
    kv.allocate("b", 10, prefix)
    shared = kv.blocks("b")[:2]
    assert [blk.ref_count for blk in shared] == [2, 2]
    kv.free_leading_blocks("a", 2)
    assert [blk.ref_count for blk in shared] == [1, 1] and kv.pool.num_used == 4
    assert kv.find_cached_prefix(tokens, hashes(tokens)).num_tokens == 8  # still cached
    kv.free("b")
    kv.free("a")
    assert kv.pool.num_used == 0


def test_freed_blocks_are_never_registered_in_the_prefix_cache_later():
    """Blocks freed before they were cached (another request may hold them now) stay out."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    kv.allocate("a", 12, EMPTY)
    kv.free_leading_blocks("a", 2)
    reused = kv.allocate("other", 8, EMPTY)
    kv.cache_full_blocks("a", tokens, hashes(tokens), 12)
    assert kv.pool.num_cached == 1  # only a's third block
    assert all(kv.pool.blocks[i].block_hash is None for i in reused)


def test_freeing_more_blocks_than_the_table_holds_is_refused():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 8, EMPTY)
    with pytest.raises(ValueError, match="holds 2 blocks"):
        kv.free_leading_blocks("a", 3)
