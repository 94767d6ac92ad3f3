"""A TP group's engine (rank 0: scheduler, model shard, sampling) and what its replica asks of it.

`GroupEngine` runs either inside the Serve replica (Serve places the group: CPU-only clusters)
or as a Ray actor in bundle 0 of a planned group's placement group (`RemoteGroupEngine`), so that
rank 0 computes on exactly the node and device the topology plan chose. Either way it streams a
request's chunks, reports the group's load, answers health checks, says where its ranks run, and
pushes the group's metrics and rank placement to the metrics store for `/metrics` and
`tpserve status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

import ray

from cluster.contract import GroupChunk, GroupRequest, LoadReport
from cluster.groups.autoscaling import KV_USAGE_METRIC
from cluster.groups.stream import stream_chunks
from cluster.metrics import existing_metrics_store, get_metrics_store
from parallel.collective_errors import sum_counts
from workers.async_engine import AsyncLLMEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.rank import RankReport

logger = logging.getLogger(__name__)


def where_am_i(device: str) -> Dict[str, Any]:
    """This process as a rank: Ray node id, the GPU the plan made visible, torch device, pid,
    the cores it may run on."""
    return {"node": ray.get_runtime_context().get_node_id(),
            "device": os.environ.get("CUDA_VISIBLE_DEVICES"), "torch_device": device,
            "pid": os.getpid(), "socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "cpus": sorted(os.sched_getaffinity(0))}


class GroupEngine:
    def __init__(self, engine_config: EngineConfig, launcher: Callable, group_id: str,
                 planned_group: Optional[int] = None) -> None:
        node_ip = ray.util.get_node_ip_address()
        self.engine = AsyncLLMEngine(
            lambda: LLMEngine(engine_config, launcher=launcher, init_host=node_ip,
                              bind_cpu_cores=engine_config.cpu_binding == "auto"))
        self.group_id = group_id
        self.planned_group = planned_group
        children = self.engine.engine.child_ranks
        actors = children.actors if children is not None else []
        self._ranks: List[Dict[str, Any]] = [where_am_i(str(self.engine.engine.rank_device))]
        self._ranks += ray.get([actor.info.remote() for actor in actors])
        self._stop = threading.Event()
        threading.Thread(target=self._push_metrics, name="tpserve-metrics-push",
                         daemon=True).start()

    async def generate(self, request: GroupRequest, routing_id: Optional[str] = None
                       ) -> AsyncIterator[GroupChunk]:
        """``routing_id``: the id the router charged the request under (listed in the load
        report's ``accepted_ids``)."""
        # aclosing: a cancelled call aborts the engine request now, not at garbage collection.
        chunks = stream_chunks(self.engine, request, routing_id=routing_id)
        async with contextlib.aclosing(chunks) as chunks:
            async for chunk in chunks:
                yield chunk

    def load_report(self) -> LoadReport:
        """The group's load for the router (the engine's latest snapshot)."""
        load = self.engine.load
        return LoadReport(
            seq=load.seq, time=load.time, num_blocks_used=load.kv.num_used_blocks,
            num_blocks_total=load.kv.num_blocks, block_size=load.kv.block_size,
            num_waiting_tokens=load.num_waiting_tokens,
            cached_block_hashes=frozenset(load.cached_block_hashes),
            accepted_ids=frozenset(load.accepted_ids), is_engine_alive=self.engine.is_alive)

    def autoscaling_stats(self) -> Dict[str, float]:
        """KV usage for the autoscaling policy (``cluster.groups.autoscaling``)."""
        return {KV_USAGE_METRIC: self.engine.load.kv.usage}

    async def health(self, rank_timeout_s: float = 5.0) -> None:
        """Raise if the engine died or a rank 1..N-1 does not answer within `rank_timeout_s`:
        an idle group whose peer's node went away fails here, not at its next request."""
        if not self.engine.is_alive:
            raise RuntimeError(f"TP group {self.group_id} engine died: {self.engine.error}")
        children = self.engine.engine.child_ranks
        actors = children.actors if children is not None else []
        try:
            await asyncio.wait_for(asyncio.gather(*[a.info.remote() for a in actors]),
                                   timeout=rank_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"TP group {self.group_id}: a rank did not answer within "
                               f"{rank_timeout_s:g} s (its node may be gone)") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"TP group {self.group_id}: a rank died: {exc}") from None

    def rank_info(self) -> List[Dict[str, Any]]:
        """Where every rank runs, rank 0 (this process) first (asked once, at start)."""
        return self._ranks

    def _push_metrics(self, period_s: float = 1.0) -> None:
        store = get_metrics_store()
        while not self._stop.wait(period_s):
            store.push.remote(self.group_id, group_metrics_snapshot(self.engine))
            store.describe.remote(self.group_id, {"ranks": self._ranks,
                                                  "planned_group": self.planned_group})

    def shutdown(self) -> None:
        self._stop.set()
        try:
            # Stopping on purpose: the store must not count this group as lost. A dead group's
            # record stays until it goes stale, so a scrape still sees its errors.
            store = existing_metrics_store()  # at teardown it may be gone: never recreate it
            if store is not None and self.engine.is_alive:
                store.remove.remote(self.group_id)
        except Exception:  # noqa: BLE001 - shutting down: say so and go on
            logger.warning("could not tell the metrics store that group %s stops", self.group_id)
        self.engine.shutdown()


RemoteGroupEngine = ray.remote(GroupEngine)


def group_metrics_snapshot(engine: AsyncLLMEngine) -> Dict:
    """The numbers a group pushes to the metrics store (see ``cluster.metrics``)."""
    load = engine.load
    eng = engine.engine
    kv = eng.scheduler.kv
    reports = eng.rank_reports()
    return {
        "engine_alive": 1.0 if engine.is_alive else 0.0,
        "kv_usage_frac": load.kv.usage,
        "kv_blocks_used": load.kv.num_used_blocks,
        "kv_blocks_total": load.kv.num_blocks,
        "tokens_in_flight": load.kv.num_filled_slots + load.num_waiting_tokens,
        "num_requests_running": load.num_running,
        "num_requests_waiting": load.num_waiting,
        "prefix_cache_queries_total": kv.num_prefix_queries,
        "prefix_cache_hits_total": kv.num_prefix_hits,
        "num_preemptions_total": eng.scheduler.num_preemptions,
        "allreduce_latency_seconds": eng.rank.tp.all_reduce_latency.drain(),
        "collective_errors_total": sum_counts(r.collective_errors for r in reports),
        **rank_memory(reports),
        **eng.kv_tier_stats(),
    }


def rank_memory(reports: List[RankReport]) -> Dict[str, Dict[str, int]]:
    """GPU memory by rank (``{"0": bytes, ...}``) of the ranks that report it; empty on CPU."""
    with_memory = [r for r in reports if r.memory is not None]
    if not with_memory:
        return {}
    return {f"gpu_memory_{field}_bytes": {str(r.rank): getattr(r.memory, f"{field}_bytes")
                                          for r in with_memory}
            for field in ("used", "total", "reserved")}
