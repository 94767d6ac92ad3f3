"""The KV-aware router called as Serve calls it, with Serve's own replica list: the loads it keeps
between decisions see every charge, every new report and the age of each report."""

from __future__ import annotations

import asyncio
import random
from typing import List

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import DeploymentHandleSource, ReplicaID  # noqa: E402

from cluster.routing import kv_router, native_rank  # noqa: E402
from cluster.routing.kv_router import KVAwareRouter  # noqa: E402
from cluster.routing.ranking import RankReason, RequestDemand, rank_groups  # noqa: E402
from cluster.routing.fleet_order import UniformRanking  # noqa: E402
from kv.prefix_hash import extend_block_hashes  # noqa: E402
from test_kv_router_ray import DEPLOYMENT, StandInReplica, request, stats  # noqa: E402


class ServeStandIn(StandInReplica):
    """A stand-in replica Serve's ``update_replicas`` accepts."""

    node_id = "node"
    availability_zone = None
    max_ongoing_requests = 8

    def __init__(self, name: str, routing_stats: dict) -> None:
        super().__init__(name, routing_stats)
        self.multiplexed_model_ids: set = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


class Serve:
    """Drives a router as Serve's routing loop does, on one event loop."""

    def __init__(self, router: KVAwareRouter) -> None:
        self.router = router
        self.loop = asyncio.new_event_loop()

    def update(self, replicas: List[ServeStandIn]) -> None:
        async def update() -> None:
            self.router.update_replicas(replicas)
            await asyncio.sleep(0)  # the probes of new replicas run

        self.loop.run_until_complete(update())

    def choose(self, pending) -> List[str]:
        ranks = self.loop.run_until_complete(
            self.router.choose_replicas(self.router._replicas_list, pending))
        return [replica.replica_id.unique_id for rank in ranks for replica in rank]

    def close(self) -> None:
        self.loop.close()


@pytest.fixture(params=["c", "python"])
def ranking(request, monkeypatch):
    """Uniform fleets ranked by the C call (`cluster.routing.native_rank`) or in Python."""
    if request.param == "python":
        monkeypatch.setenv(native_rank.SWITCH_ENV, "0")
    native_rank.load.cache_clear()
    yield request.param
    native_rank.load.cache_clear()


@pytest.fixture
def serve():
    router = KVAwareRouter(deployment_id=DEPLOYMENT,
                           handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(target_occupancy=0.70, max_report_age_s=5.0)
    driver = Serve(router)
    yield driver
    driver.close()


def test_charges_reach_the_loads_kept_between_decisions(serve):
    serve.update([ServeStandIn("a", stats(1, 40)), ServeStandIn("b", stats(1, 40))])
    pending = [request(f"r{i}", num_tokens=10 * 16) for i in range(6)]
    firsts = [serve.choose(p)[0] for p in pending]
    assert firsts == ["a", "b", "a", "b", "a", "b"]
    serve.router.on_request_routed(pending[0], ReplicaID("b", DEPLOYMENT), None)  # b took it
    assert serve.router.group_loads()["b"].num_tokens_sent_since_report == 4 * 10 * 16


def test_a_new_report_is_seen_by_the_next_decision(serve):
    serve.update([ServeStandIn("a", stats(1, 10)), ServeStandIn("b", stats(1, 30))])
    assert serve.choose(request("r1", num_tokens=16))[0] == "a"
    serve.update([ServeStandIn("a", stats(2, 90)), ServeStandIn("b", stats(1, 30))])
    assert serve.choose(request("r2", num_tokens=16))[0] == "b"


def test_reports_that_stop_arriving_turn_stale_without_a_replica_update(serve, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(kv_router.time, "time", lambda: clock[0])
    serve.update([ServeStandIn("a", stats(1, 10)), ServeStandIn("b", stats(1, 30))])

    def reasons(request_id: str) -> List[RankReason]:
        assert serve.choose(request(request_id, num_tokens=16))[0] == "a"
        return [p.reason for p in serve.router._pending[request_id].ranked]

    assert reasons("r1") == [RankReason.UNDER_TARGET] * 2
    clock[0] += 6.0  # past max_report_age_s, and no update in between
    assert reasons("r2") == [RankReason.STALE_REPORT] * 2


def _ranked_by_rank_groups(router: KVAwareRouter, pending) -> List[str]:
    loads = list(router.group_loads().values())
    demand = RequestDemand(pending.kwargs["num_tokens"], tuple(pending.kwargs["block_hashes"]),
                           16)  # the groups' block size: the router's own without a setting
    return [p.group_id for p in rank_groups(demand, loads, 0.70, 5.0)]


@pytest.mark.parametrize("num_groups", [3, 30])
def test_a_uniform_fleet_is_ranked_as_rank_groups_ranks_it(ranking, serve, num_groups):
    # 3 or 30 groups (ranked by the C call where it runs, else by rank_groups), all holding a
    # 4-block system prompt; conversations' turns follow, charged and accepted as Serve would.
    system = list(range(1, 4 * 16 + 1))
    turns = [extend_block_hashes([], system + [1000 * c + t for t in range(16 * 6)], 16)
             for c in range(5)]
    shared = turns[0][:4]
    replicas = [ServeStandIn(f"g{k:02d}", stats(1, (7 * k) % 60, cached_block_hashes=shared))
                for k in range(num_groups)]
    serve.update(replicas)
    assert (serve.router._fleet_cache.native is not None) == (ranking == "c")
    uniform = ranking == "c"
    rng = random.Random(0)
    decided = []
    for i in range(40):
        conv = turns[rng.randrange(len(turns))]
        pending = request(f"r{i}", num_tokens=rng.randrange(16, 200),
                          block_hashes=conv[:rng.randrange(4, len(conv) + 1)])
        expected = _ranked_by_rank_groups(serve.router, pending)
        assert serve.choose(pending) == expected
        ranked = serve.router._pending[f"r{i}"].ranked
        assert isinstance(ranked, UniformRanking) == uniform
        decided.append((ranked, list(ranked)))
        if i % 2:  # every other request is still routing when the next ones are decided
            # and some go to the second choice (the first was full): the charge moves there
            taker = expected[1] if i % 4 == 1 else expected[0]
            serve.router.on_request_routed(pending, ReplicaID(taker, DEPLOYMENT), None)
    # what a decision ranked stays as it was when later charges change the fleet's loads
    assert all(list(ranked) == then for ranked, then in decided)


@pytest.mark.parametrize("bad", [{"num_tokens": -5}, {"num_tokens": "12"},
                                 {"num_tokens": 12.5}])
def test_a_bad_demand_on_a_large_fleet_falls_back_as_on_a_small_one(ranking, serve, bad):
    serve.update([ServeStandIn(f"g{k:02d}", stats(1, k)) for k in range(30)])
    pending = request("r", block_hashes=[1, 2], **bad)
    assert len(serve.choose(pending)) == 2  # power of two choices
    serve.router.on_request_routed(pending, ReplicaID("g00", DEPLOYMENT), None)
    assert serve.router.decision_counts() == {kv_router.FALLBACK_BAD_DEMAND: 1}


def test_a_stale_report_sends_the_fleet_back_to_rank_groups(serve, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(kv_router.time, "time", lambda: clock[0])
    old = ServeStandIn("old", stats(1, 0))
    serve.update([old])
    clock[0] += 6.0  # past max_report_age_s: its report stopped arriving
    serve.update([old] + [ServeStandIn(f"g{k:02d}", stats(1, k)) for k in range(29)])
    pending = request("r", num_tokens=32, block_hashes=[])
    expected = _ranked_by_rank_groups(serve.router, pending)
    assert serve.choose(pending) == expected and expected[-1] == "old"
    assert isinstance(serve.router._pending["r"].ranked, list)


@pytest.mark.parametrize("num_groups", [2, 30])
def test_exact_ties_go_to_the_group_given_the_least_work_not_the_first_by_id(ranking, serve,
                                                                             num_groups):
    # Idle groups with equal reports tie on every key but the group id. Broken by the id, every
    # new conversation that arrived while the groups were idle went to the first group: on the
    # serving benchmark all 13 such decisions of two runs
    # (docs/benchmarks/routing-policy.md#tie-break). The router breaks them by the tokens its
    # groups accepted so far.
    names = [f"g{k:02d}" for k in range(num_groups)]
    serve.update([ServeStandIn(name, stats(1, 0)) for name in names])
    taken = []
    for i in range(3):
        pending = request(f"r{i}", num_tokens=64)
        first = serve.choose(pending)[0]
        serve.router.on_request_routed(pending, ReplicaID(first, DEPLOYMENT), None)
        taken.append(first)
        # the group's report lists the request, done and gone: the groups tie again
        seq = 2 + i
        serve.update([ServeStandIn(name, stats(seq, 0, accepted_ids=[f"r{i}"]))
                      for name in names])
    assert taken == [names[i % num_groups] for i in range(3)]
    # a group that took more work than the others loses the tie to them
    pending = request("big", num_tokens=640)
    serve.choose(pending)
    serve.router.on_request_routed(pending, ReplicaID(names[-1], DEPLOYMENT), None)
    serve.update([ServeStandIn(name, stats(9, 0, accepted_ids=["big"])) for name in names])
    order = serve.choose(request("r9", num_tokens=64))
    assert order[0] == (names[3] if num_groups > 3 else names[0]) and order[-1] == names[-1]


@pytest.mark.parametrize("num_groups", [2, 30])
def test_a_decision_away_from_the_longest_cached_prefix_is_counted_with_its_blocks(
        ranking, serve, num_groups):
    # g00 holds 6 of the request's 8 blocks but is full; the others hold none and are idle. The
    # request goes elsewhere, giving up 6 cached blocks. The router counts what it sent there as
    # cached: the same request again gives up none there, and 2 on g00.
    system = list(range(1, 8 * 16 + 1))
    hashes = extend_block_hashes([], system, 16)
    serve.update([ServeStandIn("g00", stats(1, 99, cached_block_hashes=hashes[:6]))]
                 + [ServeStandIn(f"g{k:02d}", stats(1, 0)) for k in range(1, num_groups)])
    pending = request("away", num_tokens=8 * 16, block_hashes=hashes)
    taker = serve.choose(pending)[0]
    assert taker != "g00"
    serve.router.on_request_routed(pending, ReplicaID(taker, DEPLOYMENT), None)
    again = request("again", num_tokens=8 * 16, block_hashes=hashes)
    serve.choose(again)
    serve.router.on_request_routed(again, ReplicaID(taker, DEPLOYMENT), None)
    away = "under_target_from_least_loaded"  # g00 (99 + 2 of 100) is past the target
    assert serve.router.prefix_given_up() == {"decisions": {away: 1}, "blocks": {away: 6}}
    back = request("back", num_tokens=8 * 16, block_hashes=hashes)
    serve.choose(back)
    serve.router.on_request_routed(back, ReplicaID("g00", DEPLOYMENT), None)
    assert serve.router.prefix_given_up()["blocks"]["least_loaded_from_under_target_prefix"] == 2
