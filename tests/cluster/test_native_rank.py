"""The router's C ranking of a uniform fleet (`cluster.routing.native_rank`) equals the one
policy, `cluster.routing.ranking.rank_groups`, on fleets built as the router builds them (real
trackers, a real prefix index, charges moving the kept order); and where it cannot rank (not
loaded, too many groups, a bad demand) the router ranks with `rank_groups`."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.contract import LoadReport
from cluster.routing import native_rank
from cluster.routing.load_report import FleetLoads, ReplicaLoadTracker
from cluster.routing.fleet_order import UniformRanking
from cluster.routing.ranking import RequestDemand, rank_groups
from cluster.routing.prefix_index import PrefixIndex
from cluster.routing.settings import RouterSettings
from kv.native_build import CACHE_ENV
from kv.prefix_hash import extend_block_hashes

BS = 8


@pytest.fixture(scope="module")
def module():
    built = native_rank.load()
    assert built is not None, "the C ranking did not build here (see the warning logged)"
    return built


class Replica:
    """What FleetLoads reads of Serve's RunningReplica."""

    def __init__(self, name: str, routing_stats: dict) -> None:
        self.replica_id = type("Id", (), {"unique_id": name})()
        self.routing_stats = routing_stats


def report(used: int, total: int, cached, waiting: int = 0) -> dict:
    return LoadReport(seq=1, time=0.0, num_blocks_used=used, num_blocks_total=total,
                      block_size=BS, num_waiting_tokens=waiting,
                      cached_block_hashes=frozenset(cached), accepted_ids=frozenset()).to_stats()


def build_fleet(groups, index: PrefixIndex, extra_groups: int = 0):
    """``groups``: (used, total, cached hashes, waiting, tokens charged since) per group, named
    out of index order; ``extra_groups`` more groups hold bits in the index, not in the fleet."""
    trackers = {}
    for k in range(extra_groups):  # e.g. a group gone from Serve's list, its bit kept
        ReplicaLoadTracker(f"other-{k}", 60.0, index).observe(
            report(0, 100, [h for g in groups for h in g[2]][:3]), time.time())
    replicas = [Replica(f"g{(7 * k) % 97:02d}", report(used, total, cached, waiting))
                for k, (used, total, cached, waiting, _) in enumerate(groups)]

    def tracker_of(replica):
        name = replica.replica_id.unique_id
        if name not in trackers:
            trackers[name] = ReplicaLoadTracker(name, 60.0, index)
        return trackers[name]

    fleet = FleetLoads(replicas, tracker_of, time.time(), 5.0, keep_order=True)
    for k, (*_, sent) in enumerate(groups):  # charges after the report move the kept order
        if sent:
            tracker = trackers[replicas[k].replica_id.unique_id]
            tracker.charge(f"r{k}", sent, time.time())
            fleet.kept.set(k, tracker.committed_blocks())
    return fleet


def charged_loads(fleet):
    """The fleet's loads with the committed blocks its kept order holds (a kept fleet's loads
    stay as the reports left them; the charges since live in ``fleet.kept``)."""
    loads = []
    for load, committed in zip(fleet.loads, fleet.kept.committed):
        load = replace(load)
        object.__setattr__(load, "_num_blocks_committed", committed)
        loads.append(load)
    return loads


def python_rank(index, fleet, hashes, num_tokens, block_size, router_settings):
    demand = RequestDemand(num_tokens, tuple(hashes), block_size)
    return rank_groups(demand, charged_loads(fleet), router_settings.target_occupancy,
                       router_settings.max_report_age_s, router_settings.prefix_weight,
                       router_settings.load_weight, index.prefix_blocks(tuple(hashes)))


@st.composite
def cases(draw):
    system = list(range(1, 1 + BS * draw(st.integers(0, 4))))
    convs = [extend_block_hashes([], system + [1000 * c + t for t in range(BS * 10)], BS)
             for c in range(4)]
    total = draw(st.sampled_from([16, 100, 512]))
    extra = draw(st.integers(0, 3))  # groups in the index, not in the fleet: all bits < 2**64
    everywhere = draw(st.booleans())  # every group holds the system prompt: the base is > 0
    groups = []
    for _ in range(draw(st.integers(1, 64 - extra))):
        cached = convs[0][:len(system) // BS] if everywhere else []
        for _ in range(draw(st.integers(0, 2))):
            conv = draw(st.sampled_from(convs))
            start = draw(st.sampled_from([0, 0, 0, 1, 3]))  # mostly a prefix, not always
            cached += conv[start:draw(st.integers(start, len(conv)))]
        groups.append((draw(st.integers(0, total)), total, cached,
                       draw(st.sampled_from([0, 0, 9, 70])), draw(st.sampled_from([0, 0, 30]))))
    conv = draw(st.sampled_from(convs))
    hashes = conv[:draw(st.integers(0, len(conv)))]
    if draw(st.booleans()):
        hashes = hashes[:1] + [7] + hashes[2:]  # a block no group holds, mid-prompt
    return groups, hashes, draw(st.integers(0, 12 * BS)), draw(st.sampled_from([BS, BS, 16])), extra


@settings(max_examples=300, deadline=None)
@given(cases(), st.floats(0.05, 1.0), st.sampled_from([0.0, 3.0]), st.sampled_from([0.0, 2.0]))
def test_the_c_ranking_equals_rank_groups(module, case, target, prefix_weight, load_weight):
    groups, hashes, num_tokens, block_size, extra = case
    router_settings = RouterSettings(target_occupancy=target, prefix_weight=prefix_weight,
                                     load_weight=load_weight)
    index = PrefixIndex(module)
    fleet = build_fleet(groups, index, extra)
    state = native_rank.fleet_state(index, fleet, router_settings)
    assert state is not None
    ranks, order, committed, prefix, base, num_blocks, got_hashes, first_tokens = module.rank(
        state, hashes, num_tokens, block_size)
    expected = python_rank(index, fleet, hashes, num_tokens, block_size, router_settings)
    assert order == [fleet.position[group.group_id] for group in expected]
    assert ranks == [fleet.ranks[i] for i in order]
    assert got_hashes == tuple(hashes)
    got = UniformRanking(order, fleet.loads, committed, prefix, base, num_blocks, target)
    assert list(got) == expected  # group for group: reasons, occupancies, prefix
    assert committed == fleet.kept.committed and committed is not fleet.kept.committed
    if order:  # the router's charge for the first choice, as _PendingDecision.tokens_on has it
        cached = expected[0].cached_prefix_blocks
        assert first_tokens == max(0, num_tokens - cached * block_size)


def test_a_next_turn_stays_with_its_history_when_every_group_holds_the_system_prompt(module):
    # test_ranking_score's case of the same name, through the C call: the prefix score counts
    # the blocks past the base (8 here, the system prompt), so "home" (17 blocks, busy) ranks
    # before the idle group holding the system prompt only.
    system = list(range(8 * BS))
    turn = extend_block_hashes([], system + list(range(1000, 1000 + 9 * BS)), BS)
    index = PrefixIndex(module)
    fleet = build_fleet([(60, 100, turn, 0, 0), (0, 100, turn[:8], 0, 0)], index)
    state = native_rank.fleet_state(index, fleet, RouterSettings())
    _, order, _, prefix, base, *_ = module.rank(state, turn, 17 * BS + 8, BS)
    assert (order, prefix, base) == ([0, 1], {0: 17}, 8)
    expected = python_rank(index, fleet, turn, 17 * BS + 8, BS, RouterSettings())
    assert [fleet.loads[i].group_id for i in order] == [p.group_id for p in expected]


def test_a_fleet_over_64_groups_or_bits_is_left_to_python(module):
    index = PrefixIndex(module)
    router_settings = RouterSettings()
    assert native_rank.fleet_state(index, build_fleet([(1, 100, [], 0, 0)] * 64, index),
                                   router_settings) is not None
    index = PrefixIndex(module)
    assert native_rank.fleet_state(index, build_fleet([(1, 100, [], 0, 0)] * 65, index),
                                   router_settings) is None
    index = PrefixIndex(module)
    wide = build_fleet([(1, 100, [], 0, 0)] * 10, index, extra_groups=60)  # bits up to 2**69
    assert wide.bits >> 64 and native_rank.fleet_state(index, wide, router_settings) is None


@pytest.mark.parametrize("num_tokens, block_size, error", [
    (-1, BS, ValueError), ("12", BS, TypeError), (12, 0, ValueError), (2**70, BS, OverflowError),
    (12, "8", TypeError)])
def test_a_demand_rank_groups_refuses_is_refused(module, num_tokens, block_size, error):
    index = PrefixIndex(module)
    fleet = build_fleet([(1, 100, [], 0, 0)] * 3, index)
    with pytest.raises(error):
        module.rank(native_rank.fleet_state(index, fleet, RouterSettings()), [1, 2], num_tokens,
                    block_size)


@pytest.fixture
def no_shipped_library(monkeypatch, tmp_path):
    """The package's library (setup.py's) missing, as in a package built without a compiler;
    what is compiled at first use instead goes to tmp_path."""
    missing = tmp_path / native_rank.LIBRARY.name
    monkeypatch.setattr(native_rank, "LIBRARY", missing)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    native_rank.load.cache_clear()
    yield missing
    native_rank.load.cache_clear()


def _records(caplog):
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == native_rank.__name__]


def test_without_the_library_it_is_compiled_at_first_use_with_one_warning(no_shipped_library,
                                                                         tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=native_rank.__name__):
        module = native_rank.load()
    assert module is not None and Path(module.__file__).parent == tmp_path / "kernels"
    assert _records(caplog) == [(logging.WARNING, (
        f"router: {no_shipped_library} is missing (the package was built without a C compiler, "
        "or this checkout without `pip install -e .`); the C ranking was compiled at first use "
        f"instead: {module.__file__}"))]


def test_without_the_library_or_a_compiler_the_router_ranks_in_python(monkeypatch,
                                                                      no_shipped_library, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.INFO, logger=native_rank.__name__):
        assert native_rank.load() is None
    [(level, message)] = _records(caplog)
    assert level == logging.WARNING and "rank in Python" in message
    assert f"{no_shipped_library} is missing" in message and "'/nonexistent/cc'" in message


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(native_rank.SWITCH_ENV, "0")
    native_rank.load.cache_clear()
    try:
        assert native_rank.load() is None
    finally:
        native_rank.load.cache_clear()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 69), st.booleans(),
                          st.lists(st.integers(0, 40).map(lambda h: h * 0x9E3779B97F4A7C15
                                                          % 2**64), max_size=12)),
                max_size=60))
def test_the_table_mirrors_the_index_through_adds_and_discards(module, ops):
    """Bits up to 2**69 (groups beyond 64: not mirrored), hashes that collide in the table's
    slots and deletions that shift later slots back."""
    index = PrefixIndex(module)
    expected = {}
    for bit_number, add, hashes in ops:
        bit = 1 << bit_number
        (index.add if add else index.discard)(bit, iter(hashes))  # an iterator, read twice
        for h in hashes:
            expected[h] = expected.get(h, 0) | bit if add else expected.get(h, 0) & ~bit
    low = {h: m % 2**64 for h, m in expected.items() if m % 2**64}
    assert module.table_masks(index.table) == low
    assert {h: m for h, m in index._masks.items()} == {h: m for h, m in expected.items() if m}


def test_the_table_grows_and_finds_every_hash_after(module):
    index = PrefixIndex(module)
    hashes = [(k * 0x9E3779B97F4A7C15) % 2**64 for k in range(5000)]
    index.add(1, hashes)
    index.add(2, hashes[::2])
    index.discard(1, hashes[1000:])
    table = module.table_masks(index.table)
    assert table == {h: (1 if k < 1000 else 0) | (2 if k % 2 == 0 else 0)
                     for k, h in enumerate(hashes) if k < 1000 or k % 2 == 0}


@pytest.mark.parametrize("bad", ["a-string-hash", -3, 2**64])
def test_a_hash_the_table_cannot_hold_leaves_fleets_to_python(module, caplog, bad):
    index = PrefixIndex(module)
    fleet = build_fleet([(1, 100, [5, 6], 0, 0)] * 3, index)
    state = native_rank.fleet_state(index, fleet, RouterSettings())
    assert state is not None
    with caplog.at_level(logging.WARNING, logger="cluster.routing.prefix_index"):
        index.add(1, [7, bad])
    assert "no longer used" in caplog.text
    assert index.table is None and native_rank.fleet_state(index, fleet, RouterSettings()) is None
    with pytest.raises(ValueError, match="could not mirror"):  # a fleet state made before
        module.rank(state, [5, 6], 16, BS)
    assert index.prefix_blocks([5, 6]) == {g.group_id: 2 for g in fleet.loads}  # Python still
