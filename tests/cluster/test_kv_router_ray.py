"""The KV-aware router: its bookkeeping on stand-in replicas (fast), then on a real Serve app.

The Ray test deploys two replicas of a stand-in group that reports real state it holds: its KV
blocks start at 90% used on the replica of rank 0 and 10% on rank 1, and grow with the tokens of
every request it accepts. Every generation request must land on the replica under target.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
)
from ray.serve._private.request_router.common import RequestRoutingContext  # noqa: E402

from cluster.routing.kv_router import (  # noqa: E402
    FALLBACK_NO_NUM_TOKENS,
    FALLBACK_NO_REPORTS,
    KVAwareRouter,
    live_routers,
)
from cluster.app import kv_aware_router_config  # noqa: E402
from cluster.contract import LoadReport  # noqa: E402
from cluster.routing.load_report import ReplicaLoadTracker  # noqa: E402
from cluster.groups.deployment import serve_routing_id  # noqa: E402
from cluster.routing.ranking import RankReason, RequestDemand  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402

DEPLOYMENT = DeploymentID(name="group", app_name="test")


def stats(seq: int, used: int, total: int = 100, *, at: Optional[float] = None,
          cached_block_hashes=(), accepted_ids=(), is_engine_alive: bool = True) -> dict:
    """A group's routing stats as Serve hands them to the router."""
    return LoadReport(seq=seq, time=time.time() if at is None else at, num_blocks_used=used,
                      num_blocks_total=total, block_size=16, num_waiting_tokens=0,
                      cached_block_hashes=frozenset(cached_block_hashes),
                      accepted_ids=frozenset(accepted_ids),
                      is_engine_alive=is_engine_alive).to_stats()


class StandInReplica:
    """What the router reads of a RunningReplica."""

    def __init__(self, name: str, routing_stats: Dict[str, Any]) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats = routing_stats


def request(request_id: str, **kwargs: Any) -> SimpleNamespace:
    """What the router reads of a PendingRequest."""
    metadata = SimpleNamespace(internal_request_id=request_id, multiplexed_model_id="")
    return SimpleNamespace(
        args=["payload"], kwargs=kwargs, metadata=metadata, routing_context=RequestRoutingContext()
    )


@pytest.fixture
def router() -> KVAwareRouter:
    kv_router = KVAwareRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN
    )
    kv_router.initialize_state(target_occupancy=0.70, max_report_age_s=5.0)
    return kv_router


def choose(router: KVAwareRouter, replicas: List[StandInReplica], pending) -> List[List[str]]:
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]


def test_a_burst_before_any_acceptance_is_spread_by_the_charges(router):
    a, b = StandInReplica("a", stats(1, 40)), StandInReplica("b", stats(1, 40))
    pending = [request(f"r{i}", num_tokens=10 * 16) for i in range(6)]
    firsts = [choose(router, [a, b], p)[0][0] for p in pending]
    assert firsts == ["a", "b", "a", "b", "a", "b"]
    for p, first in zip(pending, firsts):
        router.on_request_routed(p, ReplicaID(first, DEPLOYMENT), None)
    assert router.decision_counts() == {RankReason.UNDER_TARGET.value: 6}
    assert len(router.decision_times_us()) == 6
    # Both at 0.70 now: the next request finds no room under target.
    assert router.group_loads()["a"].projected_occupancy(0) == 0.70
    choose(router, [a, b], request("r6", num_tokens=16))
    router.on_request_routed(request("r6"), ReplicaID("a", DEPLOYMENT), None)
    assert router.decision_counts()[RankReason.OVER_TARGET.value] == 1


def test_a_request_taken_by_another_replica_moves_its_charge(router):
    a, b = StandInReplica("a", stats(1, 10)), StandInReplica("b", stats(1, 20))
    pending = request("r1", num_tokens=320)
    assert choose(router, [a, b], pending) == [["a"], ["b"]]
    # "a" refused it (full queue) and "b" took it.
    router.on_request_routed(pending, ReplicaID("b", DEPLOYMENT), None)
    loads = router.group_loads()
    assert loads["a"].num_tokens_sent_since_report == 0
    assert loads["b"].num_tokens_sent_since_report == 320
    assert router.decision_counts() == {RankReason.UNDER_TARGET.value: 1}


def test_a_follow_up_goes_where_its_history_was_sent_before_any_report_shows_it(router):
    """A conversation's next turn, routed before the group's next report lists the blocks of the
    turn before: the router counts what it sent there as cached, or the charge of that turn
    alone would push the follow-up to the other group (anti-affinity)."""
    system, history = (101, 102), (201, 202, 203, 204, 205, 206)
    reported = {"cached_block_hashes": list(system)}
    a = StandInReplica("a", stats(1, 10, **reported))
    b = StandInReplica("b", stats(1, 10, **reported))
    turn1 = request("t1", num_tokens=9 * 16, block_hashes=list(system + history[:3]))
    first = choose(router, [a, b], turn1)[0][0]
    router.on_request_routed(turn1, ReplicaID(first, DEPLOYMENT), None)
    turn2 = request("t2", num_tokens=10 * 16, block_hashes=list(system + history))
    assert choose(router, [a, b], turn2)[0][0] == first
    assert router.group_loads()[first].num_cached_prefix_blocks(
        RequestDemand(160, system + history, 16)) == 5
    # Each charged what it adds there: 9 - 2 cached blocks, then 10 - 5.
    assert router.group_loads()[first].num_tokens_sent_since_report == (7 + 5) * 16


def test_a_retry_releases_the_charge_of_its_earlier_choice(router):
    a, b = StandInReplica("a", stats(1, 10)), StandInReplica("b", stats(1, 20))
    pending = request("r1", num_tokens=320)
    choose(router, [a, b], pending)
    # Serve completes the refused attempt, then routes the request again.
    router.on_request_completed(a.replica_id, "r1")
    assert choose(router, [a, b], pending) == [["a"], ["b"]]
    assert router.group_loads()["a"].num_tokens_sent_since_report == 320
    router.on_request_routed(pending, a.replica_id, None)
    router.on_request_completed(a.replica_id, "r1")
    assert router.group_loads()["a"].num_tokens_sent_since_report == 320
    assert router.decision_counts() == {RankReason.UNDER_TARGET.value: 1}


def test_replicas_without_a_report_rank_last_together_and_none_reported_falls_back(router):
    fresh = StandInReplica("fresh", {})
    other = StandInReplica("other", {})
    full = StandInReplica("full", stats(1, 95))
    assert choose(router, [fresh, full, other], request("r1", num_tokens=16)) == [
        ["full"],
        ["fresh", "other"],
    ]
    # No reports at all: Serve's power of two choices (which sees no replicas in this router).
    assert choose(router, [fresh, other], request("r2", num_tokens=16)) == []
    router.on_request_routed(request("r2"), ReplicaID("fresh", DEPLOYMENT), None)
    router.on_request_routed(request("r1"), ReplicaID("other", DEPLOYMENT), None)
    assert router.decision_counts() == {FALLBACK_NO_REPORTS: 1, "no_report": 1}


def test_calls_without_num_tokens_use_power_of_two_choices(router):
    a = StandInReplica("a", stats(1, 10))
    assert choose(router, [a], request("ping")) == []
    router.on_request_routed(request("ping"), a.replica_id, None)
    assert router.decision_counts() == {FALLBACK_NO_NUM_TOKENS: 1}
    assert router.decision_times_us() == []


def test_a_malformed_report_leaves_the_replica_unreported(router, caplog):
    bad = StandInReplica("bad", {"seq": 1, "kv_blocks_used": 3})
    good = StandInReplica("good", stats(1, 10))
    assert choose(router, [bad, good], request("r1", num_tokens=16)) == [["good"], ["bad"]]
    assert "ignoring routing stats of replica bad" in caplog.text


def test_tracker_drops_the_charges_of_the_requests_a_report_lists():
    tracker = ReplicaLoadTracker("g")
    assert tracker.observe({}, now=100.0) is None
    tracker.observe(stats(1, 10), now=100.2)
    tracker.charge("early", 160, now=100.3)  # the group accepts it before its next report
    tracker.charge("late", 320, now=100.8)  # after it: the report cannot hold it
    assert tracker.observe(stats(1, 10), now=100.9).num_tokens_sent_since_report == 480
    load = tracker.observe(stats(2, 20, accepted_ids=["early"]), now=100.9)
    assert (load.report_seq, load.num_blocks_used) == (2, 20)
    assert load.num_tokens_sent_since_report == 320
    tracker.release("late")
    assert tracker.observe(stats(2, 20), now=100.95).num_tokens_sent_since_report == 0


@pytest.mark.parametrize("group_clock_skew_s", [-30.0, 30.0])
def test_no_clock_of_another_host_decides_what_a_report_holds(group_clock_skew_s):
    """A group's clock behind the router's kept every charge forever (its reports looked
    older than every charge); one ahead dropped charges of requests its report did not hold
    (accepted, still queued for the engine). The request ids in the report decide."""
    tracker = ReplicaLoadTracker("g")
    tracker.observe(stats(1, 10, at=100.0 + group_clock_skew_s), now=100.0)
    tracker.charge("held", 160, now=100.1)
    tracker.charge("queued", 320, now=100.2)
    load = tracker.observe(stats(2, 20, at=100.3 + group_clock_skew_s, accepted_ids=["held"]),
                           now=100.4)
    assert load.num_tokens_sent_since_report == 320
    assert load.report_age_s == pytest.approx(0.0)  # received just now, whatever its "time"


def test_routed_prompts_count_as_cached_until_their_ttl():
    tracker = ReplicaLoadTracker("g", charge_ttl_s=10.0)
    tracker.observe(stats(1, 10, cached_block_hashes=[1]), now=100.0)
    tracker.note_routed((1, 2, 3), now=100.0)
    demand = RequestDemand(64, (1, 2, 3, 4), 16)
    assert tracker.observe(stats(2, 10, cached_block_hashes=[1]), now=105.0
                           ).num_cached_prefix_blocks(demand) == 3
    # A report after the TTL that still lacks them: only what it lists counts.
    assert tracker.observe(stats(3, 10, cached_block_hashes=[1]), now=111.0
                           ).num_cached_prefix_blocks(demand) == 1


def test_report_age_is_counted_from_when_the_router_received_it():
    tracker = ReplicaLoadTracker("g")
    tracker.observe(stats(7, 0, at=0.0), now=1000.0)  # a clock far behind: still fresh
    assert tracker.observe(stats(7, 0, at=0.0), now=1001.0).report_age_s == pytest.approx(1.0)
    # The same report 60 s later: the group stopped reporting.
    assert tracker.observe(stats(7, 0, at=0.0), now=1060.0).report_age_s == pytest.approx(60.0)


def test_a_charge_no_report_ever_lists_expires_on_the_routers_clock():
    """A request cancelled while routing never reaches the group: its charge goes after
    ``charge_ttl_s``, measured by the router alone."""
    tracker = ReplicaLoadTracker("g", charge_ttl_s=10.0)
    tracker.observe(stats(1, 10), now=100.0)
    tracker.charge("cancelled", 160, now=100.0)
    assert tracker.observe(stats(2, 10), now=105.0).num_tokens_sent_since_report == 160
    assert tracker.observe(stats(3, 10), now=111.0).num_tokens_sent_since_report == 0


def test_a_stale_replica_ranks_last(router):
    stuck = StandInReplica("stuck", stats(7, 0))
    busy = StandInReplica("busy", stats(1, 90))
    tracker = router._tracker(stuck.replica_id)
    tracker.observe(stuck.routing_stats, now=time.time() - 60.0)  # received a minute ago
    assert choose(router, [stuck, busy], request("r1", num_tokens=16)) == [["busy"], ["stuck"]]
    router.on_request_routed(request("r1"), busy.replica_id, None)
    assert router.decision_counts() == {RankReason.OVER_TARGET.value: 1}


def test_report_and_config_validation():
    with pytest.raises(ValueError, match="lack"):
        LoadReport.from_stats({"seq": 1})
    with pytest.raises(ValueError, match="'kv_blocks_total' must be an int"):
        LoadReport.from_stats({**stats(1, 0), "kv_blocks_total": "100"})
    with pytest.raises(ValueError, match="target_occupancy"):
        kv_aware_router_config(target_occupancy=1.5)
    config = kv_aware_router_config(stats_period_s=0.2)
    assert config.request_router_kwargs["target_occupancy"] == 0.70
    assert config.request_routing_stats_period_s == 0.2
    assert config.request_router_kwargs["load_weight"] == 2.0
    assert kv_aware_router_config(load_weight=0.0).request_router_kwargs["load_weight"] == 0.0
    with pytest.raises(ValueError, match="must not be negative"):
        kv_aware_router_config(prefix_weight=-1.0)


_LOAD_COPY = """
import sys
from ray import cloudpickle
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
import cluster.routing.kv_router as imported

router_class = cloudpickle.loads(open(sys.argv[1], "rb").read())
router = router_class(
    deployment_id=DeploymentID(name="group", app_name="test"),
    handle_source=DeploymentHandleSource.UNKNOWN,
)
router.initialize_state(target_occupancy=0.5)
print(router_class is imported.KVAwareRouter, any(r is router for r in imported.live_routers()))
"""


def test_the_copy_serve_unpickles_in_a_caller_registers_with_the_imported_module(tmp_path):
    # Serve pickles the router's module by value; in another process that makes a second class.
    config = kv_aware_router_config(target_occupancy=0.5, stats_period_s=0.2)
    pickled = tmp_path / "router_class.pkl"
    pickled.write_bytes(config.get_serialized_request_router_cls())
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_COPY, str(pickled)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["False", "True"]


# --- a real Serve app ---------------------------------------------------------------------

NUM_BLOCKS = 1000
BLOCK_SIZE = 16
PREFIX = [11, 12, 13]  # cached on the busy replica only: must not pull requests there


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=64,
    ray_actor_options={"num_cpus": 0.1},
    request_router_config=kv_aware_router_config(stats_period_s=0.2),
)
class StandInGroup:
    """Holds a KV block count like a TP group and reports it; rank 0 starts at 90%."""

    def __init__(self) -> None:
        context = serve.get_replica_context()
        self.rank = context.rank.rank
        self.replica_id = context.replica_id.unique_id
        self.num_blocks_used = NUM_BLOCKS * (9 if self.rank == 0 else 1) // 10
        self.cached = PREFIX if self.rank == 0 else []
        self.accepted: List[str] = []
        self.seq = 0

    def generate(self, payload: str, num_tokens: int, block_hashes=()) -> dict:
        self.num_blocks_used += math.ceil(num_tokens / BLOCK_SIZE)
        self.accepted.append(serve_routing_id())
        return {"rank": self.rank, "replica_id": self.replica_id}

    def ping(self) -> dict:
        return {"rank": self.rank, "replica_id": self.replica_id}

    def record_routing_stats(self) -> dict:
        self.seq += 1
        return LoadReport(seq=self.seq, time=time.time(), num_blocks_used=self.num_blocks_used,
                          num_blocks_total=NUM_BLOCKS, block_size=BLOCK_SIZE,
                          num_waiting_tokens=0, cached_block_hashes=frozenset(self.cached),
                          accepted_ids=frozenset(self.accepted[-1000:])).to_stats()


@pytest.fixture(scope="module")
def serve_app():
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2,
             include_dashboard=False)
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(StandInGroup.bind(), name="kv_router_test", route_prefix=None)
        yield handle
    finally:
        stop_local_ray()


def _router_with_two_reports(handle, timeout_s: float = 30.0) -> KVAwareRouter:
    handle.ping.remote().result()  # the handle builds its router on first use
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        routers = [r for r in live_routers() if r.deployment_name == "StandInGroup"]
        if routers and len(routers[0].group_loads()) == 2:
            return routers[0]
        time.sleep(0.1)
    raise AssertionError("the router never saw reports from both replicas")


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_requests_avoid_the_replica_above_target(serve_app):
    router = _router_with_two_reports(serve_app)
    num_requests, num_tokens = 16, 10 * BLOCK_SIZE
    responses = [
        serve_app.generate.remote("p", num_tokens=num_tokens, block_hashes=PREFIX)
        for _ in range(num_requests)
    ]
    ranks = [response.result(timeout_s=30)["rank"] for response in responses]
    assert ranks == [1] * num_requests
    counts = router.decision_counts()
    assert counts[RankReason.UNDER_TARGET.value] == num_requests
    assert counts[FALLBACK_NO_NUM_TOKENS] == 1  # the ping
    assert not {RankReason.OVER_TARGET.value, RankReason.LEAST_LOADED.value} & set(counts)
    times_us = sorted(router.decision_times_us())
    assert len(times_us) >= num_requests
    print(f"decision time p50 {times_us[len(times_us) // 2]:.1f} us over {len(times_us)}")
    # The replicas list the requests they accepted by the id the router charged them under:
    # the next reports take every charge back (a mismatched id would leave them for the 10 s
    # TTL; reports come every 0.2 s).
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if all(load.num_tokens_sent_since_report == 0 for load in router.group_loads().values()):
            break
        time.sleep(0.1)
    assert {g: load.num_tokens_sent_since_report for g, load in router.group_loads().items()
            } == {g: 0 for g in router.group_loads()}


def test_replicas_whose_engine_died_are_never_ranked(router):
    dead = StandInReplica("dead", stats(1, 0, is_engine_alive=False))
    busy = StandInReplica("busy", stats(1, 90))
    assert choose(router, [dead, busy], request("r1", num_tokens=16)) == [["busy"]]
    # Every engine dead: no replica, and Serve must back off before asking again (else its
    # routing loop spins without yielding and never sees the replacement arrive).
    pending = request("r2", num_tokens=16)
    assert choose(router, [dead], pending) == []
    assert pending.routing_context.should_backoff
