#!/usr/bin/env python3
"""Time one routing decision of tpserve's KV-aware router against Serve's power of two choices,
in this process, with 2 to 64 groups: hot (decisions back to back) and cold (a 64 MiB buffer
walked between decisions, as the engines between two requests do to the router's caches).

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_router [--groups 2,8,64] [--decisions N]

Why cold: in the ingress a decision comes every few milliseconds at most, between engine steps
that stream hundreds of MB through the caches; the live decision times `scripts/bench_serve.py`
reads from the ingress (77-88 us with 2 and 8 groups) match this script's cold figures, not its
hot ones; so do the live ones with 64 groups (``scripts/bench_serve.py --groups 64 --num-cpus 64``
with the 2-layer test checkpoint, about 19 GB on a 24 GiB host: 139-146 us p50 against 125 cold
here; on a later host 131 us against 133 cold; docs/benchmarks/router-decision.md).

The routers are the real classes, called as Serve calls them (``choose_replicas``, then
``on_request_routed`` for the replica taken). The replicas are stand-ins carrying what a router
reads of Serve's ``RunningReplica``: an id, its routing stats (the group report of
`cluster.routing.kv_router`, 512-block pools 10-60% used, the prompts of a few conversations cached) and
its locality. Requests are turns of 200 conversations behind an 8-block system prompt every group
holds, their block hashes other int objects than the reports' (as live). The last line is JSON.

Fleets of 24 to 64 groups with one pool size rank with one C call (`cluster.routing.native_rank`); set
``TPSERVE_NATIVE_ROUTER=0`` to time the Python ranking it replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve._private.request_router.common import RequestRoutingContext
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

REPO = Path(__file__).resolve().parents[1]

from cluster.contract import LoadReport  # noqa: E402
from cluster.routing import native_rank  # noqa: E402
from cluster.routing.kv_router import KVAwareRouter  # noqa: E402
from kv.prefix_hash import extend_block_hashes  # noqa: E402

DEPLOYMENT = DeploymentID(name="TPGroup", app_name="bench-router")
BLOCK_SIZE = 8
SYSTEM_BLOCKS = 8
NUM_CONVERSATIONS = 200
FLUSH_BYTES = 64 << 20


class StandInReplica:
    """What the routers read of Serve's RunningReplica."""

    def __init__(self, name: str, routing_stats: Dict[str, Any]) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats = routing_stats
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set = set()
        self.max_ongoing_requests = 64

    async def get_queue_len(self, *, deadline_s: float) -> int:  # Serve probes new replicas
        return 0


class PendingRequest:
    """What the routers read of Serve's PendingRequest."""

    def __init__(self, request_id: str, kwargs: Dict[str, Any]) -> None:
        self.args = ["payload"]
        self.kwargs = kwargs
        self.metadata = argparse.Namespace(internal_request_id=request_id,
                                           multiplexed_model_id="")
        self.routing_context = RequestRoutingContext()


def conversations(rng: random.Random) -> List[List[int]]:
    system = list(range(1, SYSTEM_BLOCKS * BLOCK_SIZE + 1))
    return [extend_block_hashes([], system + [rng.randrange(10**6) for _ in range(256)],
                                BLOCK_SIZE) for _ in range(NUM_CONVERSATIONS)]


def fresh(hashes: List[int]) -> List[int]:
    """Equal ints that are other objects, as live: the ingress hashes each prompt itself and the
    reports' hashes arrive unpickled, so a lookup of one in the other compares values (reading
    both objects), where the same object would compare by identity."""
    return [int.from_bytes(h.to_bytes(8, "little"), "little") for h in hashes]


def fleet(num_groups: int, convs: List[List[int]], rng: random.Random) -> List[StandInReplica]:
    replicas = []
    for g in range(num_groups):
        cached = [h for c in rng.sample(convs, 3) for h in c[:rng.randrange(8, 32)]]
        replicas.append(StandInReplica(f"group-{g}", LoadReport(
            seq=1, time=time.time(), num_blocks_used=rng.randrange(51, 307),
            num_blocks_total=512, block_size=BLOCK_SIZE, num_waiting_tokens=0,
            cached_block_hashes=frozenset(cached), accepted_ids=frozenset()).to_stats()))
    return replicas


def make_router(kind: str, replicas: List[StandInReplica], loop: asyncio.AbstractEventLoop):
    """``kind``: "kv", "kv_python" (the same router with its C ranking switched off) or "pow2"."""
    cls = PowerOfTwoChoicesRequestRouter if kind == "pow2" else KVAwareRouter
    switch = os.environ.pop(native_rank.SWITCH_ENV, None)
    if kind == "kv_python":
        os.environ[native_rank.SWITCH_ENV] = "0"
    native_rank.load.cache_clear()  # the router loads it (or not) when made
    try:
        router = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    finally:
        os.environ.pop(native_rank.SWITCH_ENV, None)
        if switch is not None:
            os.environ[native_rank.SWITCH_ENV] = switch
        native_rank.load.cache_clear()
    if kind != "pow2":
        router.initialize_state(target_occupancy=0.7, max_report_age_s=3600.0)

    async def update() -> None:  # Serve calls it on its event loop
        router.update_replicas(replicas)

    loop.run_until_complete(update())
    loop.run_until_complete(asyncio.sleep(0.01))  # the probes of the new replicas finish
    return router


def decide(router: Any, replicas: List[StandInReplica], request: PendingRequest,
           loop: asyncio.AbstractEventLoop) -> tuple:
    """``(ranks, microseconds)`` of one ``choose_replicas``: the coroutine is stepped directly
    (neither router awaits anything on these paths), so no event-loop cost is timed."""
    coroutine = router.choose_replicas(replicas, request)
    begin = time.perf_counter_ns()
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value, (time.perf_counter_ns() - begin) / 1000
    coroutine.close()
    raise RuntimeError(f"{type(router).__name__}.choose_replicas awaited: not timed directly")


def time_decisions(kind: str, num_groups: int, num_decisions: int, cold: bool,
                   seed: int = 0) -> List[float]:
    """Microseconds of each timed ``choose_replicas`` call (a warm-up of 200 first)."""
    rng = random.Random(seed)
    convs = conversations(rng)
    replicas = fleet(num_groups, convs, rng)
    loop = asyncio.new_event_loop()
    router = make_router(kind, replicas, loop)
    flush = np.ones(FLUSH_BYTES // 4, dtype=np.float32) if cold else None
    times = []
    try:
        for k in range(200 + num_decisions):
            conv = rng.choice(convs)
            request = PendingRequest(f"r{k}", {
                "num_tokens": rng.randrange(200, 600), "block_size": BLOCK_SIZE,
                "block_hashes": fresh(conv[:rng.randrange(SYSTEM_BLOCKS + 1, len(conv))])})
            if flush is not None and k >= 200:
                flush += 1.0
            # Serve passes its own list, the one update_replicas built
            ranks, elapsed = decide(router, router._replicas_list, request, loop)
            router.on_request_routed(request, ranks[0][0].replica_id, None)
            if k >= 200:
                times.append(elapsed)
    finally:
        loop.close()
    return times


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(groups: Sequence[int], num_decisions: int) -> Dict[str, Any]:
    figures: Dict[str, Any] = {"num_decisions": num_decisions}
    print(f"{'groups':>6} {'mode':>5} {'kv p50':>8} {'kv p99':>8} {'py p50':>8} {'pow2 p50':>9} "
          f"{'pow2 p99':>9} {'kv/pow2':>8} {'kv/py':>6}   (us per choose_replicas; py: the KV "
          f"router ranking in Python)")
    for num_groups in groups:
        for mode in ("hot", "cold"):
            kv = time_decisions("kv", num_groups, num_decisions, mode == "cold")
            python = time_decisions("kv_python", num_groups, num_decisions, mode == "cold")
            pow2 = time_decisions("pow2", num_groups, num_decisions, mode == "cold")
            kv50, py50, pow50 = map(statistics.median, (kv, python, pow2))
            print(f"{num_groups:>6} {mode:>5} {kv50:8.1f} {percentile(kv, 0.99):8.1f} "
                  f"{py50:8.1f} {pow50:9.1f} {percentile(pow2, 0.99):9.1f} {kv50 / pow50:8.2f} "
                  f"{kv50 / py50:6.2f}", flush=True)
            figures[f"kv_us_p50_{mode}_{num_groups}"] = round(kv50, 1)
            figures[f"kv_python_us_p50_{mode}_{num_groups}"] = round(py50, 1)
            figures[f"pow2_us_p50_{mode}_{num_groups}"] = round(pow50, 1)
    return figures


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="2,8,64", help="comma-separated group counts")
    p.add_argument("--decisions", type=int, default=1000, help="timed decisions per case")
    args = p.parse_args(argv)
    try:
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        p.error(f"--groups: expected comma-separated integers, got {args.groups!r}")
    if any(g < 1 for g in groups) or args.decisions < 1:
        p.error("--groups and --decisions must be positive")
    print(json.dumps(run(groups, args.decisions)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
