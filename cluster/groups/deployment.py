"""One Serve replica = one tensor-parallel group.

Two placements, chosen by the application (`cluster.app`):

- Serve places the group (CPU-only clusters, as before): the replica starts in bundle 0 of its
  own placement group (one bundle per rank) and runs rank 0 itself; ranks 1..N-1 are Ray actors
  in bundles 1..N-1.
- The topology plan places it (`PlannedPlacement`, GPU clusters): the replica is a thin front
  that claims the next unheld planned group from the allocator (`cluster.groups.allocator`), which
  creates that group's placement group with bundle k pinned to rank k's planned node. Rank 0
  (`RemoteGroupEngine`) and ranks 1..N-1 run as actors in those bundles, each with the plan's
  `CUDA_VISIBLE_DEVICES`, `NCCL_IB_HCA` and socket interface. A replica beyond the plan logs the
  allocator's error and fails its constructor (Serve retries it); it is never placed elsewhere.

Either way the replica reports its KV load to the router through Serve's routing stats and raises
from ``check_health`` once the engine died, so Serve replaces the whole group.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Sequence

import ray
from ray import serve

from cluster.contract import GroupChunk, GroupRequest
from cluster.groups.formation import FormationConfig
from cluster.groups.claims import compute_device
from cluster.groups.engine import GroupEngine, RemoteGroupEngine, group_metrics_snapshot
from cluster.groups.rank_actor import RayRankActors
from parallel.grouping import DeviceKind
from workers.config import EngineConfig

if TYPE_CHECKING:
    from cluster.groups.allocator import PlannedClaim

__all__ = ["GroupResources", "PlannedPlacement", "TPGroupServer", "group_metrics_snapshot",
           "serve_routing_id"]

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


@dataclass(frozen=True)
class PlannedPlacement:
    """Groups go where the topology plan says (the allocator is created with `formation`)."""

    formation: FormationConfig


class TPGroupServer:
    def __init__(self, engine_config: EngineConfig, resources: GroupResources,
                 planned: Optional[PlannedPlacement] = None) -> None:
        self.group_id = serve.get_replica_context().replica_id.unique_id
        self._allocator = None
        self._host = None
        if planned is None:
            launcher = functools.partial(
                RayRankActors, placement_group=ray.util.get_current_placement_group(),
                cpus_per_rank=resources.cpus_per_rank, gpus_per_rank=resources.gpus_per_rank)
            self._engine = GroupEngine(engine_config, launcher, self.group_id)
        else:
            self._start_planned(engine_config, planned)
        logger.info("TP group %s ready (tp=%d)", self.group_id, engine_config.tp_size)

    def _start_planned(self, engine_config: EngineConfig, planned: PlannedPlacement) -> None:
        from cluster.groups.allocator import get_group_allocator

        self._allocator = get_group_allocator(planned.formation)
        me = ray.get_runtime_context().current_actor
        try:
            claim = ray.get(self._allocator.claim.remote(self.group_id, me))
        except ray.exceptions.RayTaskError as exc:  # NoPlannedGroupError: beyond the plan
            message = str(exc.cause) if exc.cause is not None else str(exc)
            logger.error("TP group %s not started: %s", self.group_id, message)
            raise RuntimeError(message) from None
        try:
            self._start_engine(engine_config, planned, claim)
        except BaseException:  # the group goes back to the plan for the next replica
            self._allocator.release.remote(self.group_id)
            raise

    def _start_engine(self, engine_config: EngineConfig, planned: PlannedPlacement,
                      claim: "PlannedClaim") -> None:
        ray.get(claim.placement_group.ready(), timeout=planned.formation.ready_timeout_s)
        plan_kind = claim.group.device_kind
        device = compute_device(engine_config.device, plan_kind)
        engine_config = dataclasses.replace(engine_config, device=device)
        logger.info("TP group %s: planned group %d %s, computing on %s", self.group_id,
                    claim.index, [(r.node, r.device) for r in claim.group.ranks], device)
        launcher = functools.partial(
            RayRankActors, placement_group=claim.placement_group,
            cpus_per_rank=planned.formation.cpus_per_rank,
            gpus_per_rank=1.0 if plan_kind is DeviceKind.CUDA else 0.0,
            env_by_rank={k: o["runtime_env"]["env_vars"] for k, o in
                         enumerate(claim.rank_options)})
        self._host = RemoteGroupEngine.options(**claim.rank_options[0]).remote(
            engine_config, launcher, self.group_id, claim.index)
        ray.get(self._host.health.remote())  # the engine is built: load errors raise here

    async def generate(self, request: GroupRequest, num_tokens: int = 0,
                       block_hashes: Sequence[int] = ()) -> AsyncIterator[GroupChunk]:
        """Stream a request's chunks (``num_tokens``/``block_hashes`` are for the router)."""
        routing_id = serve_routing_id()
        if self._host is None:
            async for chunk in self._engine.generate(request, routing_id):
                yield chunk
            return
        chunks = self._host.generate.remote(request, routing_id)
        finished = False
        try:
            async for ref in chunks:
                yield await ref
            finished = True
        finally:
            if not finished:  # the caller went away: abort the request in the engine
                ray.cancel(chunks)

    async def record_routing_stats(self) -> Dict[str, Any]:
        """The group's `LoadReport` as the dict Serve carries to the routers."""
        if self._host is None:
            report = self._engine.load_report()
        else:
            report = await self._host.load_report.remote()
        return report.to_stats()

    async def record_autoscaling_stats(self) -> Dict[str, float]:
        """KV load for the autoscaling policy (``cluster.groups.autoscaling``)."""
        if self._host is None:
            return self._engine.autoscaling_stats()
        return await self._host.autoscaling_stats.remote()

    async def check_health(self) -> None:
        if self._host is None:
            await self._engine.health()
        else:
            await self._host.health.remote()

    async def rank_info(self) -> List[Dict]:
        """Node, device and process of every rank, rank 0 first."""
        if self._host is None:
            return self._engine.rank_info()
        return await self._host.rank_info.remote()

    def __del__(self) -> None:
        engine: Optional[GroupEngine] = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        host = getattr(self, "_host", None)
        if host is not None:
            try:
                ray.get(host.shutdown.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - a dead engine is gone already
                logger.warning("TP group %s engine did not stop cleanly: %s", self.group_id, exc)
            ray.kill(host)
        allocator = getattr(self, "_allocator", None)
        if allocator is not None:
            allocator.release.remote(self.group_id)


def serve_routing_id() -> str:
    """The id the KV-aware router charged the current request under: Serve's internal request
    id, which the router sees as ``pending_request.metadata.internal_request_id`` and the
    replica in its request context ("" outside a request)."""
    return serve.context._get_serve_request_context()._internal_request_id
