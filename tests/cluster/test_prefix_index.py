"""The router's prefix index: the prefix lengths it finds for all groups in one walk equal a scan
of each group's own cached set, through reports, routed prompts, expiry and removed groups."""

from __future__ import annotations

import random
from typing import Dict, Sequence, Set

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.contract import LoadReport
from cluster.routing.load_report import ReplicaLoadTracker
from cluster.routing.ranking import GroupLoad, RequestDemand, rank_groups
from cluster.routing.prefix_index import PrefixIndex


def scanned(held: Dict[str, Set[int]], hashes: Sequence[int]) -> Dict[str, int]:
    """The leading run of ``hashes`` each group holds, by scanning its set (groups with none left
    out): what the index must find."""
    found = {}
    for group_id, cached in held.items():
        length = 0
        while length < len(hashes) and hashes[length] in cached:
            length += 1
        if length:
            found[group_id] = length
    return found


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(0, 12), max_size=10), min_size=1, max_size=70),
       st.lists(st.integers(0, 12), max_size=12))
def test_one_walk_finds_every_groups_prefix(group_sets, hashes):
    index = PrefixIndex()
    held = {f"g{i}": cached for i, cached in enumerate(group_sets)}
    for group_id, cached in held.items():
        index.add(index.add_group(group_id), cached)
    assert index.prefix_blocks(hashes) == scanned(held, hashes)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(0, 12), max_size=10), min_size=1, max_size=70),
       st.lists(st.integers(0, 12), max_size=12), st.data())
def test_split_finds_the_base_every_group_holds_and_who_holds_more(group_sets, hashes, data):
    index = PrefixIndex()
    held = {f"g{i}": cached for i, cached in enumerate(group_sets)}
    bits = {group_id: index.add_group(group_id) for group_id in held}
    for group_id, cached in held.items():
        index.add(bits[group_id], cached)
    among = data.draw(st.sets(st.sampled_from(sorted(held)), min_size=1))
    lengths = {g: n for g, n in scanned(held, hashes).items() if g in among}
    base = min(lengths.get(g, 0) for g in among)
    mask = sum(bits[g] for g in among)
    assert index.prefix_split(hashes, mask) == (
        base, {g: n for g, n in lengths.items() if n > base})
    # named by what the caller maps each bit to (the router: the group's index in its loads)
    names = {bits[g]: int(g[1:]) for g in held}
    assert index.prefix_split(hashes, mask, names) == (
        base, {int(g[1:]): n for g, n in lengths.items() if n > base})


def test_discard_and_removed_groups_leave_no_trace_and_bits_are_reused():
    index = PrefixIndex()
    a, b = index.add_group("a"), index.add_group("b")
    index.add(a, [1, 2, 3])
    index.add(b, [1, 2])
    assert index.prefix_blocks([1, 2, 3]) == {"a": 3, "b": 2}
    index.discard(a, [2])
    assert index.prefix_blocks([1, 2, 3]) == {"a": 1, "b": 2}
    index.remove_group("b", {1, 2})
    assert index.prefix_blocks([1, 2]) == {"a": 1}
    assert index.add_group("c") == b  # the freed bit, holding nothing of b's
    assert index.prefix_blocks([1, 2]) == {"a": 1}
    index.remove_group("a", {1, 3})
    assert len(index) == 0 and index.prefix_blocks([1]) == {}


def report(seq: int, cached: Sequence[int]) -> dict:
    return LoadReport(seq=seq, time=0.0, num_blocks_used=0, num_blocks_total=100, block_size=16,
                      num_waiting_tokens=0, cached_block_hashes=frozenset(cached),
                      accepted_ids=frozenset()).to_stats()


def test_trackers_keep_the_index_equal_to_what_they_count_as_cached():
    rng = random.Random(7)
    index = PrefixIndex()
    trackers = {f"g{i}": ReplicaLoadTracker(f"g{i}", charge_ttl_s=10.0, index=index)
                for i in range(6)}
    seqs = dict.fromkeys(trackers, 0)
    for step in range(400):
        now = float(step)  # routed hashes expire after 10 steps
        group_id = rng.choice(sorted(trackers))
        tracker = trackers[group_id]
        action = rng.random()
        if action < 0.4:
            seqs[group_id] += 1
            tracker.observe(report(seqs[group_id], rng.sample(range(30), rng.randrange(12))),
                            now)
        elif action < 0.9:
            tracker.note_routed([rng.randrange(30) for _ in range(rng.randrange(1, 6))], now)
        else:  # the replica goes; a new one takes its place
            tracker.close()
            trackers[group_id] = ReplicaLoadTracker(group_id, charge_ttl_s=10.0, index=index)
        held = {g: set(t._held) for g, t in trackers.items()}
        hashes = [rng.randrange(30) for _ in range(8)]
        assert index.prefix_blocks(hashes) == scanned(held, hashes), step


def test_rank_groups_ranks_the_same_with_the_index_as_by_scanning():
    rng = random.Random(3)
    for _ in range(100):
        hashes = tuple(rng.sample(range(40), 10))
        loads = [GroupLoad(f"g{i}", rng.randrange(0, 90), 100, 16, rng.randrange(64),
                           frozenset(rng.sample(range(40), 20) + list(hashes[:rng.randrange(11)])),
                           1, rng.choice((0.1, 9.0)), rng.randrange(64))
                 for i in range(8)]
        demand = RequestDemand(rng.randrange(1, 400), hashes, 16)
        index = PrefixIndex()
        for group_load in loads:
            index.add(index.add_group(group_load.group_id), group_load.cached_block_hashes)
        assert (rank_groups(demand, loads, cached_prefix=index.prefix_blocks(hashes))
                == rank_groups(demand, loads))
