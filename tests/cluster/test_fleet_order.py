"""The state the router keeps for the C ranking of a uniform fleet: which fleets are uniform,
and the order by committed blocks kept as charges move it. (That the C ranking over this state
equals `rank_groups` is tests/cluster/test_native_rank.py's.)"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.routing.fleet_order import CommittedOrder, is_uniform
from cluster.routing.ranking import GroupLoad

BS = 16


def group(gid: str, used: int, total: int, waiting: int = 0, sent: int = 0, age: float = 0.1,
          block_size: int = BS) -> GroupLoad:
    return GroupLoad(gid, used, total, block_size, waiting, frozenset(), 1, age, sent)


def test_only_fleets_of_one_pool_size_and_block_size_with_fresh_reports_are_uniform():
    assert not is_uniform([group("a", 1, 100), group("b", 1, 200)], 5.0)  # pool sizes
    assert not is_uniform([group("a", 1, 100), group("b", 1, 100, block_size=8)], 5.0)
    assert not is_uniform([group("a", 1, 100), group("b", 1, 100, age=6.0)], 5.0)  # stale
    assert not is_uniform([], 5.0)
    assert is_uniform([group("a", 1, 100), group("b", 1, 100)], 5.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(0, 11), st.integers(0, 40)), max_size=30))
def test_the_kept_order_is_the_order_by_committed_blocks_then_group_id_after_any_moves(
        used, moves):
    # ids out of index order, and equal committed counts, so the tie-break by id is exercised
    ids = [f"g{(7 * k) % 13:02d}" for k in range(len(used))]
    loads = [group(gid, n, 100) for gid, n in zip(ids, used)]
    kept = CommittedOrder(loads)
    committed = [load._num_blocks_committed for load in loads]
    for i, n in moves:
        if i < len(loads):
            kept.set(i, n)
            committed[i] = n
        assert kept.committed == committed
        assert kept.order == sorted(range(len(loads)), key=lambda i: (committed[i], ids[i]))
