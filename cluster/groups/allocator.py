"""The allocator: one named Ray actor that owns the topology plan and hands its groups to serving
replicas, one group each.

    get_group_allocator(config)   the cluster's allocator (created on first use, detached)
    allocator.claim(replica, handle) -> PlannedClaim, or raises NoPlannedGroupError
    allocator.release(replica)    a replica shutting down gives its group back
    allocator.status()            plan, claims and refusals for `tpserve status`

At start it probes every node (one task pinned to each) and plans with `parallel.grouping`, each
node's GPUs capped at what Ray offers there. A claim takes the first unheld planned group and
creates its placement group: bundle k pinned to the node of rank k (`cluster.groups.formation`), so Ray's
GPU counts stay right while the plan, not Ray, picks the device. Before refusing, it takes back
the groups of replicas that died (their actor no longer answers) and probes nodes that joined
since: their groups are appended to the plan. Refusals are shown by `tpserve status` (the latest
`MAX_REFUSALS_KEPT`) until a claim succeeds again: a refused replica's own teardown, which gives
back what it holds, does not take its refusal with it.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from cluster.groups.formation import (
    FormationConfig,
    alive_nodes,
    create_group_placement_group,
    gpu_budget,
    plan_placement,
    probe_cluster,
    rank_actor_options,
)
from cluster.groups.claims import Claim, beyond_plan_message, claim, plan_summary
from parallel.grouping import PlacementPlan, PlannedGroup
from parallel.topology import NodeName, NodeTopology

logger = logging.getLogger(__name__)

ALLOCATOR_NAME = "tpserve-group-allocator"
ALLOCATOR_NAMESPACE = "tpserve"
MAX_REFUSALS_KEPT = 16  # Serve starts a refused replica again and again: the latest are enough


class NoPlannedGroupError(RuntimeError):
    """More replicas than planned groups: this one is not placed anywhere."""


@dataclass(frozen=True)
class PlannedClaim:
    """What a replica needs to start its group: the group, its placement group and each rank's
    `.options(...)` (bundle, resources, environment)."""

    index: int
    group: PlannedGroup
    placement_group: PlacementGroup
    rank_options: List[Dict[str, Any]]


class GroupAllocator:
    def __init__(self, config: FormationConfig) -> None:
        self.config = config
        self.topologies: Dict[NodeName, NodeTopology] = probe_cluster(config.probe_timeout_s)
        self.plan: PlacementPlan = plan_placement(self.topologies, config,
                                                  gpu_budget(alive_nodes()))
        self.groups: List[PlannedGroup] = list(self.plan.groups)
        self.claims: Dict[int, Claim] = {}
        self.holders: Dict[str, Any] = {}  # replica -> its actor handle
        self.placement_groups: Dict[str, PlacementGroup] = {}
        self.refusals: "collections.OrderedDict[str, Dict[str, Any]]" = (
            collections.OrderedDict())

    def claim(self, replica: str, handle: Any) -> PlannedClaim:
        index = claim(len(self.groups), self.claims, replica, self._on_lost_nodes())
        if index is None:
            self._take_back_dead()
            self._add_joined_nodes()
            index = claim(len(self.groups), self.claims, replica, self._on_lost_nodes())
        if index is None:
            message = beyond_plan_message(replica, self._current_plan(), self.claims)
            self._refuse(replica, message)
            raise NoPlannedGroupError(message)
        self.refusals.clear()  # placed again: the plan holds the replicas that ask now
        group = self.groups[index]
        if replica not in self.placement_groups:
            self.placement_groups[replica] = create_group_placement_group(
                group, self.config, name=f"tpserve-group-{index}")
        self.claims[index] = Claim(index, replica, time.time())
        self.holders[replica] = handle
        pg = self.placement_groups[replica]
        options = [rank_actor_options(group, rank, pg, self.topologies[placement.node],
                                      self.config)
                   for rank, placement in enumerate(group.ranks)]
        logger.info("replica %s claims planned group %d: %s", replica, index,
                    [(r.node, r.device) for r in group.ranks])
        return PlannedClaim(index, group, pg, options)

    def release(self, replica: str) -> None:
        for index, held in list(self.claims.items()):
            if held.replica == replica:
                del self.claims[index]
                logger.info("replica %s gives back planned group %d", replica, index)
        self.holders.pop(replica, None)
        pg = self.placement_groups.pop(replica, None)
        if pg is not None:
            remove_placement_group(pg)

    def status(self) -> Dict[str, Any]:
        self._take_back_dead()
        return {"plan": plan_summary(self._current_plan()),
                "claims": [{"group": c.group, "replica": c.replica, "since": c.since}
                           for c in sorted(self.claims.values(), key=lambda c: c.group)],
                "refusals": list(self.refusals.values())}

    def config_in_use(self) -> Tuple[FormationConfig, int]:
        """The configuration it plans for, and how many live replicas hold its groups."""
        self._take_back_dead()
        return self.config, len(self.claims)

    def placement_groups_held(self) -> List[PlacementGroup]:
        return list(self.placement_groups.values())

    def _refuse(self, replica: str, message: str) -> None:
        logger.error("%s", message)
        self.refusals.pop(replica, None)
        self.refusals[replica] = {"replica": replica, "time": time.time(), "message": message}
        while len(self.refusals) > MAX_REFUSALS_KEPT:
            self.refusals.popitem(last=False)

    def _current_plan(self) -> PlacementPlan:
        return PlacementPlan(self.plan.tp_size, self.plan.device_kind, tuple(self.groups),
                             self.plan.left_out, self.plan.warnings)

    def _on_lost_nodes(self) -> Set[int]:
        """Planned groups with a rank on a node that is no longer alive (an autoscaler retired
        it, a pod came back under a new node id): their placement group could never be ready,
        so they are not handed out (a node that comes back alive makes them usable again)."""
        alive = alive_nodes()
        return {index for index, group in enumerate(self.groups)
                if any(rank.node not in alive for rank in group.ranks)}

    def _take_back_dead(self, timeout_s: float = 2.0) -> None:
        """Release the groups of replicas whose actor died (a replica that answers late is
        alive: only a dead actor's error frees its group)."""
        for replica, handle in list(self.holders.items()):
            ref = handle.__ray_ready__.remote()
            ready, _ = ray.wait([ref], timeout=timeout_s)
            if not ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                logger.warning("replica %s died: its planned group is free again", replica)
                self.release(replica)

    def _add_joined_nodes(self) -> None:
        """Probe nodes that joined since the plan and append the groups they make among
        themselves (a new node's GPUs are never joined with older nodes' leftovers)."""
        joined = {node_id for node_id in alive_nodes() if node_id not in self.topologies}
        if not joined:
            return
        new = probe_cluster(self.config.probe_timeout_s, skip=frozenset(self.topologies))
        self.topologies.update(new)
        try:
            more = plan_placement(new, FormationConfig(**{**self.config.__dict__,
                                                          "num_groups": None}),
                                  gpu_budget(alive_nodes()))
        except ValueError as exc:
            logger.warning("nodes %s joined but form no group: %s", sorted(new), exc)
            return
        self.groups += list(more.groups)
        self.plan = PlacementPlan(self.plan.tp_size, self.plan.device_kind, tuple(self.groups),
                                  self.plan.left_out + more.left_out,
                                  self.plan.warnings + more.warnings)
        logger.info("%d node(s) joined: %d more planned group(s)", len(new), len(more.groups))


GroupAllocatorActor = ray.remote(GroupAllocator)


class AllocatorConfigError(RuntimeError):
    """The cluster's allocator plans for another configuration, and replicas still hold it."""


def get_group_allocator(config: Optional[FormationConfig] = None):
    """The cluster's allocator; created (detached, no CPU) with `config` when it does not exist.

    The allocator outlives applications (it is detached), so one deployed again with another
    formation (another TP size, say) finds the old one. With no live replica holding its groups
    it is replaced; else `AllocatorConfigError` says which configuration holds the cluster."""
    if config is None:
        return ray.get_actor(ALLOCATOR_NAME, namespace=ALLOCATOR_NAMESPACE)
    handle = _allocator(config)
    current, num_held = ray.get(handle.config_in_use.remote(), timeout=120)
    if current == config:
        return handle
    if num_held:
        raise AllocatorConfigError(
            f"the cluster's planned placement was made for {current} and {num_held} live "
            f"replica(s) still hold its groups; this deployment asks for {config}. Delete the "
            f"application that holds them (serve delete), then deploy again")
    logger.warning("replacing the group allocator planned for %s (no replica holds it) with "
                   "one for %s", current, config)
    if _same_actor(handle):  # else another replica replaced it meanwhile
        kill_group_allocator()
    return get_group_allocator(config)


def _allocator(config: FormationConfig):
    return GroupAllocatorActor.options(
        name=ALLOCATOR_NAME, namespace=ALLOCATOR_NAMESPACE, get_if_exists=True,
        lifetime="detached", num_cpus=0).remote(config)


def _same_actor(handle) -> bool:
    try:
        named = ray.get_actor(ALLOCATOR_NAME, namespace=ALLOCATOR_NAMESPACE)
    except ValueError:
        return False
    return named._actor_id == handle._actor_id


def kill_group_allocator() -> None:
    """Remove the allocator and so every planned placement group it holds."""
    try:
        handle = ray.get_actor(ALLOCATOR_NAME, namespace=ALLOCATOR_NAMESPACE)
    except ValueError:
        return  # never created: Serve placed the groups
    try:
        for pg in ray.get(handle.placement_groups_held.remote(), timeout=10):
            remove_placement_group(pg)
    except Exception as exc:  # noqa: BLE001 - best effort: the actor may be dying already
        logger.warning("could not list the allocator's placement groups: %s", exc)
    ray.kill(handle)

