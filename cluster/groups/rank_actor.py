"""Ranks 1..N-1 of a TP group as Ray actors in the group replica's placement group.

A thin Ray wrapper around ``workers.rank``: the actor builds its rank (joining the process group
that rank 0 opens) and serves plans on one thread, while ``wait_ready`` answers on another. Ray
is the control plane only; every step's plan arrives over torch.distributed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import List, Mapping, Optional

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.multiproc import RANK_STOP_S
from workers.rank import RankConfig, RankReport, build_rank, rank_report, serve_plans

logger = logging.getLogger(__name__)


@ray.remote(max_concurrency=2)
class RankActor:
    def __init__(self) -> None:
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._rank = None

    def run(self, config: RankConfig) -> None:
        """Build the rank, then serve plans until rank 0 broadcasts shutdown (blocks)."""
        self._device = config.device
        try:
            rank = build_rank(config)
        except BaseException as exc:  # reported through wait_ready
            self._error = exc
            self._ready.set()
            return
        self._rank = rank
        self._ready.set()
        try:
            serve_plans(rank)
        finally:
            rank.tp.destroy()

    def wait_ready(self, timeout_s: float) -> None:
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"rank not ready after {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    def report(self) -> Optional[RankReport]:
        """This rank's failed collectives and GPU memory (None before it is built); answers
        while ``run`` serves plans, and after a failed collective ended it."""
        return rank_report(self._rank) if self._rank is not None else None

    def info(self) -> dict:
        """Where this rank runs: node id, the GPU it was given, torch device, process id, the
        cores it may run on."""
        return {"node": ray.get_runtime_context().get_node_id(),
                "device": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "torch_device": getattr(self, "_device", None), "pid": os.getpid(),
                "socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                "cpus": sorted(os.sched_getaffinity(0))}


def rank_device(device: str) -> str:
    """A rank actor sees one GPU (Ray's, or the plan's `CUDA_VISIBLE_DEVICES`): `cuda:k` of the
    engine's numbering is its `cuda:0`; `cpu` stays `cpu`, whatever the bundle reserves."""
    return "cuda:0" if device.startswith("cuda") else device


class RayRankActors:
    """``workers.multiproc.RankLauncher`` for Ray: rank k goes to bundle k of ``placement_group``,
    with ``env_by_rank[k]`` (a planned group's device and interfaces) in its environment."""

    def __init__(self, configs: List[RankConfig], placement_group: PlacementGroup,
                 cpus_per_rank: float, gpus_per_rank: float,
                 env_by_rank: Optional[Mapping[int, Mapping[str, str]]] = None) -> None:
        self.actors = []
        self._runs = []
        self._reports: List[Optional[RankReport]] = [None] * len(configs)
        for config in configs:
            rank = config.group.rank
            config = dataclasses.replace(config, device=rank_device(config.device))
            env = dict((env_by_rank or {}).get(rank, {}))
            actor = RankActor.options(
                num_cpus=cpus_per_rank, num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=rank),
                name=None, **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote()
            self.actors.append(actor)
            self._runs.append(actor.run.remote(config))

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        refs = [actor.wait_ready.remote(timeout_s) for actor in self.actors]
        try:
            ray.get(refs, timeout=timeout_s + 10)
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def check(self) -> None:
        """Raise what stopped a rank, if one has stopped (its ``run`` ended: it failed to build,
        or its actor died); does not wait."""
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for ref in done:
            index = self._runs.index(ref)
            try:
                ray.get(ref)  # an actor that died raises here
                ray.get(self.actors[index].wait_ready.remote(0))  # a rank that failed to build
            except ray.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            raise RuntimeError(f"rank {index + 1} stopped before its group was ready")

    def reports(self, timeout_s: float = 1.0) -> List[RankReport]:
        """Each rank's report as it answers within ``timeout_s``, else its last one (a rank
        whose actor died keeps its last report)."""
        refs = [actor.report.remote() for actor in self.actors]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            index = refs.index(ref)
            try:
                report = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            if report is not None:
                self._reports[index] = report
        return [report for report in self._reports if report is not None]

    def join(self, timeout_s: float = RANK_STOP_S) -> None:
        try:
            ray.get(self._runs, timeout=timeout_s)
        except Exception as exc:  # a rank that died or hung: kill it, the group is going away
            logger.warning("rank actors did not stop cleanly within %g s (%s): killing them",
                           timeout_s, exc)
        for actor in self.actors:
            ray.kill(actor)
