"""The pure ranking policy: at, above and exactly on the target, ties, stale reports, bursts,
cached prefixes, bad input, and the ranking's properties (the weighted score that orders the
groups under target: test_ranking_score.py)."""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.routing.ranking import (
    GroupLoad,
    RankedGroup,
    RankReason,
    RequestDemand,
    rank_groups,
    tied_with_first,
)
from kv.prefix_hash import extend_block_hashes

R = RankReason
BS = 16


def load(
    group_id: str,
    used: int,
    total: int = 100,
    *,
    waiting: int = 0,
    sent: int = 0,
    cached=(),
    age: float = 0.1,
    block_size: int = BS,
    seq: int = 1,
) -> GroupLoad:
    return GroupLoad(
        group_id=group_id,
        num_blocks_used=used,
        num_blocks_total=total,
        block_size=block_size,
        num_waiting_tokens=waiting,
        cached_block_hashes=frozenset(cached),
        report_seq=seq,
        report_age_s=age,
        num_tokens_sent_since_report=sent,
    )


def demand(num_tokens: int, hashes=()) -> RequestDemand:
    return RequestDemand(num_tokens, tuple(hashes), BS if hashes else None)


def ids(ranked: List[RankedGroup]) -> List[str]:
    return [p.group_id for p in ranked]


def test_projected_occupancy_rounds_each_term_up_to_blocks():
    # used 10 + ceil(17/16)=2 waiting + ceil(1/16)=1 sent + ceil(16/16)=1 request = 14 of 100.
    group = load("g", 10, waiting=17, sent=1)
    assert group.projected_occupancy(16) == 14 / 100
    assert group.projected_occupancy(17) == 15 / 100
    assert group.projected_occupancy(0) == 13 / 100
    [ranked_group] = rank_groups(demand(16), [group])
    assert ranked_group.projected_occupancy == group.projected_occupancy(16)


def test_under_target_group_comes_first_even_when_busier_one_sorts_first_by_id():
    # "a" would reach 0.75, "b" 0.50: only "b" is under target.
    ranked = rank_groups(demand(5 * BS), [load("a", 70), load("b", 45)])
    assert ranked == [
        RankedGroup("b", R.UNDER_TARGET, 0.50, 0),
        RankedGroup("a", R.OVER_TARGET, 0.75, 0),
    ]


def test_exactly_at_target_counts_as_under():
    # 65 + 5 = 70 of 100 blocks: exactly 0.70.
    at_target, over = load("at", 65), load("over", 66)
    ranked = rank_groups(demand(5 * BS), [over, at_target])
    assert [(p.group_id, p.reason) for p in ranked] == [
        ("at", R.UNDER_TARGET),
        ("over", R.OVER_TARGET),
    ]
    assert ranked[0].projected_occupancy == 0.70
    # One token more needs a sixth block: now both are over.
    assert rank_groups(demand(5 * BS + 1), [at_target])[0].reason is R.OVER_TARGET


@pytest.mark.parametrize("total", [10, 20, 50, 100, 1000, 4000])
def test_exactly_at_target_holds_for_every_pool_size(total):
    needed = int(round(0.7 * total))
    assert needed / total == 0.7
    ranked = rank_groups(demand(BS), [load("g", needed - 1, total)])
    assert ranked[0].reason is R.UNDER_TARGET


def test_when_every_group_is_over_target_the_least_loaded_goes_first():
    # Nothing cached: over the target the score is the load alone; past a full pool, too.
    loads = [load("a", 95), load("b", 80), load("c", 99), load("d", 100)]
    ranked = rank_groups(demand(2 * BS), loads)
    assert [(p.group_id, p.reason, p.projected_occupancy) for p in ranked] == [
        ("b", R.OVER_TARGET, 0.82), ("a", R.OVER_TARGET, 0.97), ("c", R.LEAST_LOADED, 1.01),
        ("d", R.LEAST_LOADED, 1.02)]


def test_over_target_a_conversation_stays_with_its_history_while_its_pool_holds_the_request():
    """Ranked by load alone over the target, a turn left its history for a group whose committed
    blocks were lower by more than the history (here 72 + 10 against 88 + 2 of 100), and its
    re-prefill there raised the load further. Now the history's group keeps it until the
    request no longer fits its pool."""
    hashes = extend_block_hashes([], list(range(8 * BS)), BS)
    request = demand(10 * BS, hashes)
    loads = [load("a_cold", 72), load("b_history", 88, cached=hashes)]
    assert [(p.group_id, p.reason, p.projected_occupancy) for p in rank_groups(request, loads)] == [
        ("b_history", R.OVER_TARGET_PREFIX, 0.90), ("a_cold", R.OVER_TARGET, 0.82)]
    # 99 + 2: the history's pool no longer holds the request: the least loaded takes it.
    loads = [load("a_cold", 72), load("b_history", 99, cached=hashes)]
    assert [(p.group_id, p.reason) for p in rank_groups(request, loads)] == [
        ("a_cold", R.OVER_TARGET), ("b_history", R.LEAST_LOADED)]
    # A new conversation (nothing cached anywhere) goes to the least loaded.
    assert ids(rank_groups(demand(10 * BS, [7, 8]), [load("b", 88), load("a", 72)])) == ["a", "b"]


def test_ties_break_by_group_id_whatever_the_input_order():
    loads = [load(f"g{i}", 30) for i in range(8)] + [load("h", 20)]
    expected = ["h"] + [f"g{i}" for i in range(8)]
    rng = random.Random(0)
    for _ in range(10):
        rng.shuffle(loads)
        assert ids(rank_groups(demand(BS), loads)) == expected


def test_no_groups_gives_an_empty_ranking():
    assert rank_groups(demand(100), []) == []


def test_stale_report_ranks_after_every_fresh_group_even_an_over_target_one():
    loads = [
        load("stale_empty", 0, age=6.0),
        load("busy", 90, age=0.4),
        load("ok", 50, age=0.4),
    ]
    ranked = rank_groups(demand(BS), loads, max_report_age_s=5.0)
    assert [(p.group_id, p.reason) for p in ranked] == [
        ("ok", R.UNDER_TARGET),
        ("busy", R.OVER_TARGET),
        ("stale_empty", R.STALE_REPORT),
    ]


def test_report_exactly_at_the_age_limit_is_still_fresh():
    ranked = rank_groups(demand(BS), [load("g", 0, age=5.0)], max_report_age_s=5.0)
    assert ranked[0].reason is R.UNDER_TARGET


def test_stale_groups_rank_among_themselves_by_load():
    loads = [load("x", 50, age=9.0), load("y", 10, age=7.0)]
    ranked = rank_groups(demand(BS), loads, max_report_age_s=5.0)
    assert ids(ranked) == ["y", "x"]
    assert {p.reason for p in ranked} == {R.STALE_REPORT}


def _route_burst(loads: Dict[str, GroupLoad], num_requests: int, num_tokens: int) -> List[str]:
    """Routes like the router between two reports: each request's tokens are added to the
    chosen group's ``num_tokens_sent_since_report``."""
    chosen = []
    for _ in range(num_requests):
        best = rank_groups(demand(num_tokens), list(loads.values()))[0].group_id
        sent = loads[best].num_tokens_sent_since_report + num_tokens
        loads[best] = dataclasses.replace(loads[best], num_tokens_sent_since_report=sent)
        chosen.append(best)
    return chosen


def test_a_burst_between_two_reports_spills_over_once_a_group_reaches_target():
    # Both reported 40 of 100 blocks used. Each request needs 10 blocks; without the sent-token
    # accounting all six would go to "a" (the tie-break) and take it to 1.00.
    loads = {"a": load("a", 40), "b": load("b", 40)}
    chosen = _route_burst(loads, 6, 10 * BS)
    assert chosen == ["a", "b", "a", "b", "a", "b"]
    assert loads["a"].projected_occupancy(0) == 0.70
    # The next request fits nowhere under target: least loaded, and the two are tied.
    ranked = rank_groups(demand(10 * BS), list(loads.values()))
    assert [(p.group_id, p.reason) for p in ranked] == [
        ("a", R.OVER_TARGET),
        ("b", R.OVER_TARGET),
    ]


def test_sent_tokens_push_the_prefix_group_over_target_so_the_next_request_goes_elsewhere():
    # 4 of the request's 10 blocks cached: a shared prefix, not a history (is_history)
    hashes = extend_block_hashes([], list(range(4 * BS)), BS)
    request = demand(10 * BS, hashes)
    loads = {"a": load("a", 20, cached=hashes), "b": load("b", 50)}
    chosen = []
    for _ in range(6):
        best = rank_groups(request, list(loads.values()))[0]
        chosen.append((best.group_id, best.reason))
        sent = loads[best.group_id].num_tokens_sent_since_report + request.num_tokens
        loads[best.group_id] = dataclasses.replace(
            loads[best.group_id], num_tokens_sent_since_report=sent
        )
    # "a" holds the prefix, so it takes requests up to 0.70 exactly, busier than "b" or not.
    assert chosen == [("a", R.UNDER_TARGET_PREFIX)] * 5 + [("b", R.UNDER_TARGET)]
    # The next report holds the sent tokens in "used": the ranking is the same.
    reported = [load("a", 70, cached=hashes, seq=2), load("b", 60, seq=2)]
    assert ids(rank_groups(request, reported)) == ids(rank_groups(request, list(loads.values())))
    assert ids(rank_groups(request, reported)) == ["b", "a"]


def test_a_history_lifts_its_group_over_the_target_above_one_under_it_while_its_pool_holds():
    """Kept below the target's line (the policy before), a conversation's next turn left its
    history as soon as its group passed the target and another had not: on the serving
    benchmark at 3.5 req/s (docs/benchmarks/routing-policy.md#history) 28 of 800 decisions
    gave up 1,260 cached blocks so, and the hit rate was 0.05 under prefix affinity's. The
    history's group now ranks with the groups under the target, by the score, until its pool no
    longer holds the request."""
    hashes = extend_block_hashes([], list(range(4 * BS)), BS)
    # 6 blocks asked, 4 of them cached in "cached_but_full": 69 + 2 = 0.71 there, 0.66 cold.
    loads = [load("cached_but_full", 69, cached=hashes), load("cold", 60)]
    ranked = rank_groups(demand(6 * BS, hashes), loads)
    assert [(p.group_id, p.reason, p.projected_occupancy) for p in ranked] == [
        ("cached_but_full", R.OVER_TARGET_PREFIX, 0.71),
        ("cold", R.UNDER_TARGET, 0.66),
    ]
    # A longer request whose history is a small part of it: the load decides (2 of 12 blocks
    # cached, 0.81 against 0.52).
    longer = extend_block_hashes([], list(range(12 * BS)), BS)
    loads = [load("history", 71, cached=longer[:2]), load("cold", 40)]
    assert ids(rank_groups(demand(12 * BS, longer), loads)) == ["cold", "history"]
    # When every group is over target, the prefix counts again while the pool holds the
    # request (90 + 2 against 80 + 6), and no longer past it (99 + 2).
    loads = [load("cached_but_full", 90, cached=hashes), load("cold", 80)]
    assert ids(rank_groups(demand(6 * BS, hashes), loads)) == ["cached_but_full", "cold"]
    loads = [load("cached_but_full", 99, cached=hashes), load("cold", 80)]
    assert ids(rank_groups(demand(6 * BS, hashes), loads)) == ["cold", "cached_but_full"]


def test_cached_blocks_take_no_new_blocks_so_they_do_not_count_against_the_target():
    """A conversation's next turn: 8 of its 10 blocks cached where the turn before ran. That
    group takes 2 new blocks (0.62), the other would take 10 (0.70, on the target): charging the
    whole request to both (0.70 and 0.70) ranked them by id, the history's group last."""
    hashes = extend_block_hashes([], list(range(8 * BS)), BS)
    request = demand(10 * BS, hashes)
    loads = [load("a_cold", 60), load("b_history", 60, cached=hashes)]
    ranked = rank_groups(request, loads)
    assert [(p.group_id, p.projected_occupancy, p.cached_prefix_blocks) for p in ranked] == [
        ("b_history", 0.62, 8), ("a_cold", 0.70, 0)]
    # Both over target: the history's group still comes first.
    loads = [load("a_cold", 75), load("b_history", 80, cached=hashes)]
    assert [(p.group_id, p.reason) for p in rank_groups(request, loads)] == [
        ("b_history", R.OVER_TARGET_PREFIX), ("a_cold", R.OVER_TARGET)]


def test_only_leading_blocks_count_and_block_sizes_must_match():
    hashes = extend_block_hashes([], list(range(5 * BS)), BS)
    gap = load("gap", 0, cached=[hashes[0], hashes[1], hashes[3], hashes[4]])
    assert gap.num_cached_prefix_blocks(demand(5 * BS, hashes)) == 2
    late = load("late", 0, cached=hashes[1:])
    assert late.num_cached_prefix_blocks(demand(5 * BS, hashes)) == 0
    other_size = load("other", 0, cached=hashes, block_size=32, total=50)
    assert other_size.num_cached_prefix_blocks(demand(5 * BS, hashes)) == 0
    ranked = rank_groups(demand(5 * BS, hashes), [other_size, gap])
    assert [(p.group_id, p.cached_prefix_blocks) for p in ranked] == [("gap", 2), ("other", 0)]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: RequestDemand(-1), "num_tokens"),
        (lambda: RequestDemand(1.5), "num_tokens"),
        (lambda: RequestDemand(10, (1, 2)), "block_size is required"),
        (lambda: RequestDemand(10, (1, 2), 0), "block_size must be positive"),
        (lambda: load("g", 0, total=0), "num_blocks_total must be positive"),
        (lambda: load("g", 101, total=100), "num_blocks_used"),
        (lambda: load("g", -1), "num_blocks_used"),
        (lambda: load("g", 0, block_size=0), "block_size must be positive"),
        (lambda: load("g", 0, waiting=-5), "must not be negative"),
        (lambda: load("g", 0, sent=-5), "must not be negative"),
        (lambda: load("g", 0, age=-0.1), "report_age_s"),
        (lambda: load("g", 0, age=float("nan")), "report_age_s"),
        (lambda: load("", 0), "group_id"),
        (lambda: rank_groups(demand(1), [load("g", 0)], target_occupancy=0.0), "target"),
        (lambda: rank_groups(demand(1), [load("g", 0)], target_occupancy=1.5), "target"),
        (lambda: rank_groups(demand(1), [load("g", 0)], max_report_age_s=0), "max_report"),
        (lambda: rank_groups(demand(1), [load("g", 0), load("g", 5)]), "distinct"),
    ],
)
def test_bad_input_raises_value_error_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# --- properties ---------------------------------------------------------------------------

TARGET = 0.70


@st.composite
def scenarios(draw):
    num_groups = draw(st.integers(0, 8))
    pool = draw(st.lists(st.integers(0, 2**63 - 1), min_size=6, max_size=6, unique=True))
    loads = []
    for index in range(num_groups):
        total = draw(st.integers(1, 200))
        loads.append(
            GroupLoad(
                group_id=f"g{draw(st.integers(0, 3))}{index}",
                num_blocks_used=draw(st.integers(0, total)),
                num_blocks_total=total,
                block_size=draw(st.sampled_from([BS, BS, BS, 32])),
                num_waiting_tokens=draw(st.integers(0, 2000)),
                cached_block_hashes=frozenset(draw(st.lists(st.sampled_from(pool), max_size=6))),
                report_seq=1,
                report_age_s=draw(st.sampled_from([0.0, 0.5, 4.9, 5.0, 5.1, 60.0])),
                num_tokens_sent_since_report=draw(st.integers(0, 2000)),
            )
        )
    hashes = draw(st.lists(st.sampled_from(pool), max_size=6, unique=True))
    request = RequestDemand(draw(st.integers(0, 3000)), tuple(hashes), BS)
    return request, loads


def _naive_prefix(group: GroupLoad, request: RequestDemand) -> int:
    if group.block_size != request.block_size:
        return 0
    count = 0
    for block_hash in request.block_hashes:
        if block_hash not in group.cached_block_hashes:
            break
        count += 1
    return count


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_ranking_properties(scenario):
    request, loads = scenario
    ranked = rank_groups(request, loads, TARGET, max_report_age_s=5.0)
    by_id = {group.group_id: group for group in loads}
    assert sorted(ids(ranked)) == sorted(by_id)  # every group exactly once
    def occupancy(group: GroupLoad) -> float:
        fresh = group.report_age_s <= 5.0
        cached = _naive_prefix(group, request) if fresh else 0
        return group.projected_occupancy(request.num_tokens, cached)

    fresh = [p for p in ranked if p.reason is not R.STALE_REPORT]
    base = min((p.cached_prefix_blocks for p in fresh), default=0)

    def tier(p: RankedGroup) -> int:  # under the target, or holding a history the pool holds: 0
        if p.reason is R.STALE_REPORT:
            return 3
        num_blocks = -(-request.num_tokens // by_id[p.group_id].block_size)
        history = 2 * (p.cached_prefix_blocks - base) > num_blocks - base  # over half past base
        if p.projected_occupancy <= TARGET or (history and p.projected_occupancy <= 1.0):
            return 0
        return 1 if p.projected_occupancy <= 1.0 else 2

    tiers = [tier(p) for p in ranked]
    assert tiers == sorted(tiers)
    if any(p.projected_occupancy <= TARGET for p in fresh):
        assert tiers[0] == 0
    for p in fresh:  # the reason says where the group is, whatever its tier
        expected = ((R.UNDER_TARGET, R.UNDER_TARGET_PREFIX) if p.projected_occupancy <= TARGET
                    else (R.OVER_TARGET, R.OVER_TARGET_PREFIX)
                    if p.projected_occupancy <= 1.0 else (R.LEAST_LOADED,) * 2)
        assert p.reason is expected[p.cached_prefix_blocks > 0]
    for p in ranked:
        group = by_id[p.group_id]
        assert p.projected_occupancy == occupancy(group)
        if p.reason is R.STALE_REPORT:
            assert p.cached_prefix_blocks is None
        else:
            assert p.cached_prefix_blocks == min(_naive_prefix(group, request),
                                                 -(-request.num_tokens // group.block_size))
    # Within a tier: higher score first (tier 0: the load against its highest occupancy; tier 1:
    # against the whole pool), then lower occupancy, then id.
    scale = (max((p.projected_occupancy for p, t in zip(ranked, tiers) if t == 0),
                 default=0.0), 1.0)
    keys = [
        (t, _naive_score(p, request, scale[t], base) if t < 2 else 0.0,
         p.projected_occupancy, p.group_id)
        for p, t in zip(ranked, tiers)
    ]
    assert keys == sorted(keys, key=lambda k: (k[0], round(k[1], 9), k[2], k[3]))
    # Without a load weight: the strict order, longer prefix first.
    strict = rank_groups(request, loads, TARGET, max_report_age_s=5.0, load_weight=0.0)
    keys = [(tier(p), -p.cached_prefix_blocks if tier(p) < 2 else 0,
             p.projected_occupancy,
             p.group_id) for p in strict]
    assert keys == sorted(keys)


def _naive_score(p: RankedGroup, request: RequestDemand, highest: float, base: int) -> float:
    """-(3 x prefix fraction past the base + 2 x (1 - occupancy / highest)) for groups of a
    scored tier."""
    if p.cached_prefix_blocks is None:
        return 0.0
    num_hashes = len(request.block_hashes)
    prefix = (p.cached_prefix_blocks - base) / (num_hashes - base) if num_hashes > base else 0
    return -(3 * prefix + 2 * (1 - p.projected_occupancy / highest if highest else 1))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 50), max_size=40, unique=True),
    st.lists(st.integers(0, 50), max_size=60),
)
def test_cached_prefix_count_is_the_leading_run(request_hashes, cached):
    group = load("g", 0, cached=cached)
    request = RequestDemand(1, tuple(request_hashes), BS)
    assert group.num_cached_prefix_blocks(request) == _naive_prefix(group, request)


def test_tied_with_first_counts_the_leading_groups_told_apart_by_their_id_alone():
    hashes = [11, 12, 13]
    # c and a: idle, both hold the first block; b: busier; d: idle but holds all three
    loads = [load("c", 0, cached=[11]), load("b", 5, cached=[11]), load("a", 0, cached=[11]),
             load("e", 0)]
    ranked = rank_groups(demand(4 * BS, hashes), loads)
    assert ids(ranked)[:2] == ["a", "c"] and tied_with_first(ranked) == 2
    # the same occupancy by another prefix (d: 2 blocks more used, 2 more cached) is no tie
    loads.append(load("d", 2, cached=hashes))
    ranked = rank_groups(demand(4 * BS, hashes), loads, load_weight=0.0)
    assert ids(ranked)[0] == "d" and tied_with_first(ranked) == 1
    assert tied_with_first([]) == 0
    # stale groups tie among themselves too
    stale = rank_groups(demand(BS), [load("x", 3, age=9.0), load("w", 3, age=9.0)])
    assert tied_with_first(stale) == 2
