"""Ranks 1..N-1 as Ray actors (``cluster.groups.rank_actor.RayRankActors``) while rank 0 waits for them
at the rendezvous: a rank that fails before it joins fails rank 0 at once, with its error; a rank
whose collective fails later reports it to rank 0 (``RayRankActors.reports``)."""

from __future__ import annotations

import dataclasses
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from cluster.groups.rank_actor import RayRankActors  # noqa: E402
from ray_clusters import loopback_cluster  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def one_node():
    with loopback_cluster([dict(num_cpus=2)]) as cluster:
        yield cluster


def test_a_rank_actor_that_fails_before_the_rendezvous_fails_rank_0_at_once(one_node,
                                                                             tiny_llama):
    # Rank 0 waited RENDEZVOUS_S (10 minutes) for a rank actor that had already failed.
    group = placement_group([{"CPU": 0.1}] * 2)
    ray.get(group.ready(), timeout=60)
    launched = []

    def launcher(configs):  # rank 1 fails in its actor before it joins the group
        launched.append(RayRankActors([dataclasses.replace(c, num_threads=-1) for c in configs],
                                      group, cpus_per_rank=0.1, gpus_per_rank=0.0))
        return launched[-1]

    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="positive"):
            LLMEngine(EngineConfig(model=str(tiny_llama), tp_size=2, num_kv_blocks=64),
                      launcher=launcher)
        assert time.monotonic() - started < 60
    finally:
        for actor in launched[0].actors if launched else ():
            ray.kill(actor)
        remove_placement_group(group)


def test_a_rank_actors_failed_collective_reaches_rank_0(one_node, tiny_llama):
    group = placement_group([{"CPU": 0.1}] * 2)
    ray.get(group.ready(), timeout=60)

    def launcher(configs):
        return RayRankActors(configs, group, cpus_per_rank=0.1, gpus_per_rank=0.0)

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), tp_size=2, num_kv_blocks=64,
                                    step_timeout_s=1.5), launcher=launcher)
    try:
        # Rank 0 sends no plan past the step timeout: rank 1's wait for one times out.
        with engine._keepalive.lock:
            deadline = time.monotonic() + 30
            while engine.collective_errors()["timeout"] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            reports = {r.rank: r.collective_errors for r in engine.rank_reports()}
        assert reports == {0: {"error": 0, "timeout": 0, "hang": 0},
                           1: {"error": 0, "timeout": 1, "hang": 0}}
    finally:
        engine.shutdown(failed=True)
        remove_placement_group(group)
