"""Form TP groups on a Ray cluster from what its nodes report.

    probe_cluster()                 one probe task pinned to each alive node -> {node id: topology}
    gpu_budget(alive_nodes())       the GPUs Ray offers per node: the plan never uses more
    plan_placement(topologies, cfg) the pure plan (`parallel.grouping`), nodes named by Ray node id
    create_group_placement_group()  one bundle per rank, each pinned to its planned node
    rank_actor_options()            `.options(...)` for rank k: its bundle, device and NCCL env
    form_groups() / launch_rank_actors()   all of the above, for callers that want the whole path

Ray assigns GPUs to bundles by its own bookkeeping, which knows nothing of NVLink islands. A rank
therefore gets its device from the plan: `CUDA_VISIBLE_DEVICES` in the actor's runtime_env, with
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1` so that Ray does not overwrite it (Ray 2.60 also
keeps a runtime_env value narrower than its pool, worker.py `get_accelerator_ids_for_...`; the
variable makes that hold whatever the version). The bundle still reserves one GPU on that node, so
Ray's counts stay right, though not necessarily for the same GPU instance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from parallel.grouping import DeviceKind, PlacementPlan, PlannedGroup, plan_groups
from parallel.rank_env import rank_env
from parallel.topology import NodeName, NodeTopology
from parallel.topology_probe import probe_node

logger = logging.getLogger(__name__)

# Read by Ray's NVIDIA accelerator manager in the worker (ray/_private/accelerators/nvidia_gpu.py).
NOSET_CUDA_VISIBLE_DEVICES_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class FormationConfig:
    """How many groups of what size, and what each rank reserves."""

    tp_size: int
    num_groups: Optional[int] = None  # None: as many as the cluster holds
    cpus_per_rank: float = 1.0  # fractional on small hosts (2 cores hold no 2x1-CPU group)
    cpu_ranks_per_node: Optional[int] = None  # CPU-only clusters; None: the node's core count
    socket_ifname: Optional[str] = None  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME when set
    probe_timeout_s: float = 60.0
    ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if self.num_groups is not None and self.num_groups < 1:
            raise ValueError(f"num_groups must be None or positive, got {self.num_groups!r}")
        if not self.cpus_per_rank > 0:
            raise ValueError(f"cpus_per_rank must be > 0 (a bundle cannot be empty), got "
                             f"{self.cpus_per_rank!r}")
        for label in ("probe_timeout_s", "ready_timeout_s"):
            if not getattr(self, label) > 0:
                raise ValueError(f"{label} must be > 0, got {getattr(self, label)!r}")


@dataclass(frozen=True)
class FormedGroup:
    """A planned group and the placement group that holds its ranks' bundles (bundle k = rank k)."""

    group: PlannedGroup
    placement_group: PlacementGroup


@ray.remote(num_cpus=0)
def _probe_task(node_id: str, address: str) -> NodeTopology:
    return probe_node(name=node_id, address=address)


def alive_nodes() -> dict[NodeName, dict]:
    """`ray.nodes()` entries of the alive nodes, by node id."""
    return {NodeName(node["NodeID"]): node for node in ray.nodes() if node["Alive"]}


def probe_cluster(timeout_s: float = 60.0, skip: frozenset = frozenset()
                  ) -> dict[NodeName, NodeTopology]:
    """Probe every alive node once (but those in `skip`), with a task pinned to it; topologies
    are named by node id and know the interface of the node's Ray address."""
    nodes = {node_id: node for node_id, node in alive_nodes().items() if node_id not in skip}
    refs = [_probe_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id, soft=False)).remote(node_id, node["NodeManagerAddress"])
        for node_id, node in nodes.items()]
    topologies = ray.get(refs, timeout=timeout_s)
    logger.info("probed %d node(s) (GPUs, fabric, its active ports): %s", len(topologies),
                {t.name: (len(t.gpus), t.fabric()[0], len(t.fabric()[1])) for t in topologies})
    return {topology.name: topology for topology in topologies}


def gpu_budget(nodes: Mapping[NodeName, dict]) -> dict[NodeName, int]:
    """The GPUs Ray offers on each node (its `GPU` resource): a plan never uses more there."""
    return {node_id: int(node.get("Resources", {}).get("GPU", 0)) for node_id, node in nodes.items()}


def plan_placement(topologies: Mapping[NodeName, NodeTopology], config: FormationConfig,
                   budget: Optional[Mapping[NodeName, int]] = None) -> PlacementPlan:
    """The plan over `topologies`, each node's GPUs capped at `budget` (None: no cap). A node
    where Ray counts GPUs but the probe saw none is refused by name: planning it as a CPU node
    would run a GPU cluster's ranks on CPU without a word."""
    blind = sorted(f"{name} ({budget[name]} GPU(s))" for name, topology in topologies.items()
                   if budget and budget.get(name, 0) > 0 and not topology.gpus)
    if blind:
        raise ValueError(
            f"Ray counts GPUs on node(s) {', '.join(blind)} but the topology probe found none "
            f"there: install nvidia-ml-py in the image or put nvidia-smi on the PATH of Ray's "
            f"workers (a CPU plan for GPU nodes is not made)")
    plan = plan_groups(topologies.values(), config.tp_size, config.num_groups,
                       cpu_ranks_per_node=config.cpu_ranks_per_node, gpu_budget=budget)
    for line in plan.explanation():
        logger.info("plan: %s", line)
    return plan


def group_bundles(group: PlannedGroup, config: FormationConfig) -> list[dict[str, float]]:
    """One bundle per rank: `cpus_per_rank` CPUs, plus one GPU on GPU plans."""
    bundle = {"CPU": config.cpus_per_rank}
    if group.device_kind is DeviceKind.CUDA:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in group.ranks]


def create_group_placement_group(group: PlannedGroup, config: FormationConfig,
                                 name: str = "") -> PlacementGroup:
    """The placement group of one planned group; bundle k is pinned to the node of rank k (the
    plan's node names are Ray node ids, as `probe_cluster` names them). Not waited for."""
    selectors = [{NODE_ID_LABEL_KEY: rank.node} for rank in group.ranks]
    return placement_group(group_bundles(group, config), strategy="PACK", name=name,
                           bundle_label_selector=selectors)


def rank_actor_options(group: PlannedGroup, rank: int, pg: PlacementGroup,
                       topology: NodeTopology, config: FormationConfig) -> dict[str, Any]:
    """Options for the actor of rank `rank`: its bundle, its resources and its environment."""
    env_vars = rank_env(group, rank, topology, config.socket_ifname)
    if group.device_kind is DeviceKind.CUDA:
        env_vars[NOSET_CUDA_VISIBLE_DEVICES_ENV] = "1"
    return {
        "num_cpus": config.cpus_per_rank,
        "num_gpus": 1 if group.device_kind is DeviceKind.CUDA else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank),
        "runtime_env": {"env_vars": env_vars},
    }


def form_groups(config: FormationConfig,
                topologies: Optional[Mapping[NodeName, NodeTopology]] = None
                ) -> tuple[PlacementPlan, list[FormedGroup]]:
    """Probe (unless given topologies), plan, and create every group's placement group; returns
    once all are ready. On failure the placement groups made so far are removed."""
    if topologies is None:
        topologies = probe_cluster(config.probe_timeout_s)
    plan = plan_placement(topologies, config)
    formed: list[FormedGroup] = []
    try:
        for group in plan.groups:
            formed.append(FormedGroup(group, create_group_placement_group(group, config)))
        ray.get([item.placement_group.ready() for item in formed], timeout=config.ready_timeout_s)
    except BaseException:
        remove_groups(formed)
        raise
    return plan, formed


def launch_rank_actors(formed: FormedGroup, actor_class: Any,
                       topologies: Mapping[NodeName, NodeTopology], config: FormationConfig,
                       *args: Any, **kwargs: Any) -> list[Any]:
    """One `actor_class` (a `ray.remote` class) per rank, rank k in bundle k with its device."""
    return [
        actor_class.options(**rank_actor_options(
            formed.group, rank, formed.placement_group, topologies[placement.node], config,
        )).remote(*args, **kwargs)
        for rank, placement in enumerate(formed.group.ranks)
    ]


def remove_groups(formed: list[FormedGroup]) -> None:
    for item in formed:
        remove_placement_group(item.placement_group)
