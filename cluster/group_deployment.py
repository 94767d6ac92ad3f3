"""One Serve replica = one tensor-parallel group.

The replica starts in bundle 0 of its own placement group (one bundle per rank) and runs rank 0:
the scheduler, its model shard and sampling, on the engine thread beside the replica's event
loop. Ranks 1..N-1 are Ray actors in bundles 1..N-1. The replica reports its KV load to the
router through Serve's routing stats and raises from ``check_health`` once the engine has died
(a rank actor that dies breaks rank 0's collective), so Serve replaces the whole group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Dict, List, Optional, Sequence

import ray
from ray import serve

from cluster.autoscaling import KV_USAGE_METRIC
from cluster.group_stream import stream_chunks
from cluster.metrics import existing_metrics_store, get_metrics_store
from cluster.rank_actor import RayRankActors
from workers.async_engine import AsyncLLMEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupResources:
    """What each rank's bundle holds; derived from the configuration and the cluster."""

    cpus_per_rank: float
    gpus_per_rank: float

    def bundles(self, tp_size: int) -> List[Dict[str, float]]:
        bundle = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            bundle["GPU"] = self.gpus_per_rank
        return [dict(bundle) for _ in range(tp_size)]


class TPGroupServer:
    def __init__(self, engine_config: EngineConfig, resources: GroupResources) -> None:
        placement_group = ray.util.get_current_placement_group()
        launcher = functools.partial(RayRankActors, placement_group=placement_group,
                                     cpus_per_rank=resources.cpus_per_rank,
                                     gpus_per_rank=resources.gpus_per_rank)
        node_ip = ray.util.get_node_ip_address()
        self.engine = AsyncLLMEngine(
            lambda: LLMEngine(engine_config, launcher=launcher, init_host=node_ip))
        self.group_id = serve.get_replica_context().replica_id.unique_id
        self._stop = threading.Event()
        threading.Thread(target=self._push_metrics, name="tpserve-metrics-push",
                         daemon=True).start()
        logger.info("TP group %s ready (tp=%d)", self.group_id, engine_config.tp_size)

    async def generate(self, payload: dict, num_tokens: int = 0,
                       block_hashes: Sequence[int] = ()) -> AsyncIterator[dict]:
        """Stream a request's chunks (``num_tokens``/``block_hashes`` are for the router)."""
        # aclosing: a cancelled call aborts the engine request now, not at garbage collection.
        chunks = stream_chunks(self.engine, payload, routing_id=serve_routing_id())
        async with contextlib.aclosing(chunks) as chunks:
            async for chunk in chunks:
                yield chunk

    def record_routing_stats(self) -> Dict:
        load = self.engine.load
        return {
            "seq": load.seq,
            "time": load.time,
            "kv_blocks_used": load.kv.num_used_blocks,
            "kv_blocks_total": load.kv.num_blocks,
            "block_size": load.kv.block_size,
            "waiting_tokens": load.num_waiting_tokens,
            "cached_block_hashes": list(load.cached_block_hashes),
            "accepted_ids": list(load.accepted_ids),
            "engine_alive": self.engine.is_alive,
        }

    def record_autoscaling_stats(self) -> Dict[str, float]:
        """KV load for the autoscaling policy (``cluster.autoscaling``)."""
        return {KV_USAGE_METRIC: self.engine.load.kv.usage}

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError(f"TP group {self.group_id} engine died: {self.engine.error}")

    def rank_info(self) -> List[Dict]:
        """Node id and process id of every rank, rank 0 (this replica) first."""
        children = self.engine.engine.child_ranks
        actors = children.actors if children is not None else []
        here = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        return [here] + ray.get([actor.info.remote() for actor in actors])

    def _push_metrics(self, period_s: float = 1.0) -> None:
        store = get_metrics_store()
        while not self._stop.wait(period_s):
            store.push.remote(self.group_id, group_metrics_snapshot(self.engine))

    def __del__(self) -> None:
        stop: Optional[threading.Event] = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            try:
                # Stopping on purpose: the store must not count this group as lost. A dead
                # group's record stays until it goes stale, so a scrape still sees its errors.
                store = existing_metrics_store()  # at teardown it may be gone: never recreate it
                if store is not None and self.engine.is_alive:
                    store.remove.remote(self.group_id)
            except Exception:
                logger.warning("could not tell the metrics store that group %s stops",
                               self.group_id)
        engine: Optional[AsyncLLMEngine] = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def serve_routing_id() -> str:
    """The id the KV-aware router charged the current request under: Serve's internal request
    id, which the router sees as ``pending_request.metadata.internal_request_id`` and the
    replica in its request context ("" outside a request)."""
    return serve.context._get_serve_request_context()._internal_request_id


def group_metrics_snapshot(engine: AsyncLLMEngine) -> Dict:
    """The numbers a group pushes to the metrics store (see ``cluster.metrics``)."""
    load = engine.load
    eng = engine.engine
    kv = eng.scheduler.kv
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
        "collective_errors_total": eng.rank.tp.num_collective_errors,
        **eng.kv_tier_stats(),
    }
