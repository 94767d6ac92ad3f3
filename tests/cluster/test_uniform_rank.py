"""The router's fast ranking for uniform fleets equals `rank_groups`' ranking, Placement for
Placement, and gives way to it (None) wherever the fleet is not uniform."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.routing.ranking import GroupLoad, RequestDemand, rank_groups, tied_with_first
from cluster.routing.uniform_rank import CommittedOrder, is_uniform, rank_uniform

BS = 16


def group(gid: str, used: int, total: int, waiting: int = 0, sent: int = 0, age: float = 0.1,
          block_size: int = BS) -> GroupLoad:
    return GroupLoad(gid, used, total, block_size, waiting, frozenset(), 1, age, sent)


def split_prefixes(cached_prefix, position):
    """(base, index -> blocks for the groups holding more) from each group's count of leading
    blocks held, as `PrefixIndex.prefix_split` gives them (test_prefix_index.py checks it)."""
    held = {position[g]: n for g, n in cached_prefix.items() if g in position}
    base = min(held.values()) if len(held) == len(position) else 0
    return base, {i: n for i, n in held.items() if n > base}


def fast(demand, loads, cached, target=0.7, max_age=5.0, prefix_weight=3.0, load_weight=2.0,
         load_scale="highest"):
    """rank_uniform as the router calls it, or None where it would call rank_groups."""
    if not is_uniform(loads, max_age):
        return None
    position = {load.group_id: i for i, load in enumerate(loads)}
    base, longer = split_prefixes(cached, position)
    return rank_uniform(demand, loads, CommittedOrder(loads), base, longer, target,
                        prefix_weight, load_weight, load_scale)


@st.composite
def fleets(draw):
    total = draw(st.sampled_from([8, 50, 512]))
    num_groups = draw(st.integers(1, 9))
    # ids out of order, so the stable sort's tie-break by group id is exercised
    ids = draw(st.permutations([f"g{k}" for k in range(num_groups)]))
    loads = [group(gid, draw(st.integers(0, total)), total,
                   waiting=draw(st.sampled_from([0, 0, 5, 40])),
                   sent=draw(st.sampled_from([0, 0, 16, 300])),
                   age=draw(st.floats(0.0, 5.0)))
             for gid in ids]
    num_hashes = draw(st.integers(0, 12))
    hashes = tuple(range(100, 100 + num_hashes))
    demand = RequestDemand(draw(st.integers(0, 20 * BS)), hashes, BS if hashes else None)
    shared = draw(st.integers(0, num_hashes))  # a system prompt every group may hold
    cached = {}
    for load in loads:
        held = draw(st.one_of(st.just(shared), st.integers(0, num_hashes)))
        if held:
            cached[load.group_id] = held
    if draw(st.booleans()):
        cached["gone"] = num_hashes  # a group the index still knows, not in this fleet
    return demand, loads, cached


@settings(max_examples=400, deadline=None)
@given(fleets(), st.floats(0.05, 1.0), st.sampled_from([0.0, 1.0, 3.0]),
       st.sampled_from([0.0, 2.0, 5.0]), st.sampled_from(["highest", "target"]))
def test_fast_ranking_equals_rank_groups(fleet, target, prefix_weight, load_weight, scale):
    demand, loads, cached = fleet
    expected = rank_groups(demand, loads, target, 5.0, prefix_weight, load_weight,
                           cached_prefix=cached, load_scale=scale)
    ranking = fast(demand, loads, cached, target, 5.0, prefix_weight, load_weight, scale)
    assert ranking is not None
    assert list(ranking) == expected
    assert [loads[i].group_id for i in ranking.order] == [p.group_id for p in expected]
    assert ranking[0] == expected[0] and ranking[-1] == expected[-1]
    assert ranking.tied_with_first() == tied_with_first(expected)


def test_a_conversations_group_is_placed_by_its_score_among_the_base_groups():
    # Every group holds the 4-block system prompt; "b" also the conversation's next 4 blocks.
    loads = [group("a", 10, 100), group("b", 20, 100), group("c", 5, 100), group("d", 80, 100)]
    demand = RequestDemand(10 * BS, tuple(range(10)), BS)
    cached = {"a": 4, "b": 8, "c": 4, "d": 4}
    ranking = fast(demand, loads, cached)
    assert [p.group_id for p in ranking] == ["b", "c", "a", "d"]
    assert [p.group_id for p in ranking] == [
        p.group_id for p in rank_groups(demand, loads, cached_prefix=cached)]


def test_fleets_that_are_not_uniform_are_left_to_rank_groups():
    demand = RequestDemand(BS, (1,), BS)
    assert fast(demand, [group("a", 1, 100), group("b", 1, 200)], {}) is None  # pool sizes
    assert fast(demand, [group("a", 1, 100), group("b", 1, 100, block_size=8)], {}) is None
    assert fast(demand, [group("a", 1, 100), group("b", 1, 100, age=6.0)], {}) is None  # stale
    assert fast(demand, [], {}) is None
    assert fast(demand, [group("a", 1, 100), group("b", 1, 100)], {}) is not None


def test_a_request_hashed_at_another_block_size_has_no_affinity_as_in_rank_groups():
    loads = [group("a", 30, 100, block_size=8), group("b", 10, 100, block_size=8)]
    demand = RequestDemand(4 * BS, (1, 2, 3, 4), BS)
    cached = {"a": 4}
    assert list(fast(demand, loads, cached)) == rank_groups(demand, loads, cached_prefix=cached)
    assert fast(demand, loads, cached)[0].group_id == "b"


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
