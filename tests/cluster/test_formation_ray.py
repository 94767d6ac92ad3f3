"""Group formation on a two-node `ray.cluster_utils.Cluster` with fake GPUs.

Each node's raylet (and so every worker on it) carries `TPSERVE_TOPOLOGY_NVSMI_FILE` and
`TPSERVE_TOPOLOGY_IBSTAT_FILE`, pointing the probe at real `nvidia-smi topo -m` and `ibstat`
outputs (2 GPUs over PHB, 8 active 200 Gb/s HCAs). Every rank reports where it runs; the test
checks it is exactly the node and device the plan gave it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.util.placement_group import (  # noqa: E402
    NODE_ID_LABEL_KEY,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from cluster.groups.formation import (  # noqa: E402
    NOSET_CUDA_VISIBLE_DEVICES_ENV,
    FormationConfig,
    FormedGroup,
    create_group_placement_group,
    form_groups,
    launch_rank_actors,
    plan_placement,
    probe_cluster,
    remove_groups,
)
from parallel.grouping import DeviceKind, RankPlacement  # noqa: E402
from parallel.topology import GpuTopology  # noqa: E402
from parallel.topology_probe import IBSTAT_FILE_ENV, NVSMI_FILE_ENV  # noqa: E402
from ray_clusters import loopback_cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

DATA = Path(__file__).resolve().parents[1] / "data" / "topology"
NODE_ENV = {
    NVSMI_FILE_ENV: str(DATA / "nvidia-smi-topo_pcie2_phb.txt"),
    IBSTAT_FILE_ENV: str(DATA / "ibstat_a100_all_active.txt"),
}
CONFIG = dict(cpus_per_rank=0.1)


@ray.remote(num_cpus=0)
class RankReporter:
    """Stands in for a rank actor: says where it runs and what it was given."""

    def where(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nccl_ib_hca": os.environ.get("NCCL_IB_HCA"),
            "ray_gpu_ids": ray.get_gpu_ids(),
        }


@pytest.fixture(scope="module")
def two_node_cluster():
    # The raylet's environment reaches every worker it starts, so each probe reads its node's.
    with loopback_cluster([dict(num_cpus=1, num_gpus=2, env_vars=NODE_ENV)] * 2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def topologies(two_node_cluster):
    return probe_cluster(timeout_s=60)


def _reports(formed: FormedGroup, topologies, config) -> list[dict]:
    actors = launch_rank_actors(formed, RankReporter, topologies, config)
    try:
        return ray.get([actor.where.remote() for actor in actors], timeout=60)
    finally:
        for actor in actors:
            ray.kill(actor)


def _assert_ranks_where_planned(formed_groups, topologies, config) -> list[list[dict]]:
    all_reports = []
    for formed in formed_groups:
        reports = _reports(formed, topologies, config)
        for placement, report in zip(formed.group.ranks, reports, strict=True):
            assert report["node_id"] == placement.node
            assert report["cuda_visible_devices"] == str(placement.device)
        all_reports.append(reports)
    return all_reports


def test_probe_reads_each_nodes_fixture(topologies):
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert set(topologies) == alive and len(alive) == 2
    for topology in topologies.values():
        assert [gpu.index for gpu in topology.gpus] == [0, 1]
        assert str(topology.links[0][1]) == "PHB"
        assert len(topology.active_ib_ports()) == 8  # mlx5_0 is Ethernet, not counted
        assert any(source.startswith("file:") for source in topology.sources)


def test_tp2_groups_stay_inside_each_node(topologies):
    config = FormationConfig(tp_size=2, **CONFIG)
    plan, formed = form_groups(config, topologies)
    try:
        assert len(plan.groups) == 2
        assert all(not group.spans_nodes for group in plan.groups)
        reports = _assert_ranks_where_planned(formed, topologies, config)
        assert all(report["nccl_ib_hca"] is None for group in reports for report in group)
    finally:
        remove_groups(formed)


def test_tp4_group_spans_both_nodes_over_ib(topologies):
    config = FormationConfig(tp_size=4, **CONFIG)
    plan, formed = form_groups(config, topologies)
    try:
        (group,) = plan.groups
        assert set(group.node_names) == set(topologies)
        assert [len(group.devices_on(node)) for node in group.node_names] == [2, 2]
        reports = _assert_ranks_where_planned(formed, topologies, config)
        expected = "=" + ",".join(f"mlx5_{k}:1" for k in range(1, 9))
        assert all(report["nccl_ib_hca"] == expected for report in reports[0])
    finally:
        remove_groups(formed)


@ray.remote(num_cpus=0, num_gpus=1)
def _ray_gpu_ids() -> list:
    return ray.get_gpu_ids()


def test_rank_gets_planned_device_not_rays_choice(topologies):
    """Another tenant holds one GPU of a node; a lone rank planned on that very GPU still sees it
    (Ray's bookkeeping reserves the other, free GPU instance for the rank's bundle)."""
    node = sorted(topologies)[0]
    holder = placement_group([{"CPU": 0.1, "GPU": 1}],
                             bundle_label_selector=[{NODE_ID_LABEL_KEY: node}])
    try:
        ray.get(holder.ready(), timeout=60)
        (held,) = ray.get(_ray_gpu_ids.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(holder, 0)).remote(), timeout=60)
        config = FormationConfig(tp_size=1, **CONFIG)
        plan = plan_placement(topologies, config)
        group = next(g for g in plan.groups if g.ranks[0] == RankPlacement(node, int(held)))
        formed = FormedGroup(group, create_group_placement_group(group, config))
        try:
            ray.get(formed.placement_group.ready(), timeout=60)
            (report,) = _assert_ranks_where_planned([formed], topologies, config)[0]
            assert report["cuda_visible_devices"] == str(held)
        finally:
            remove_groups([formed])
    finally:
        remove_placement_group(holder)


def test_cpu_only_path_spans_nodes_over_tcp(topologies):
    """The same formation path with CPU ranks: no GPU resources, no device variables."""
    cpu_only = {name: dataclasses.replace(t, gpu_topology=GpuTopology())
                for name, t in topologies.items()}
    config = FormationConfig(tp_size=2, cpu_ranks_per_node=1, **CONFIG)
    plan, formed = form_groups(config, cpu_only)
    try:
        (group,) = plan.groups
        assert plan.device_kind is DeviceKind.CPU and set(group.node_names) == set(topologies)
        assert all("GPU" not in bundle for bundle in formed[0].placement_group.bundle_specs)
        for placement, report in zip(group.ranks, _reports(formed[0], cpu_only, config),
                                     strict=True):
            assert report["node_id"] == placement.node
            assert report["nccl_ib_hca"] is None and report["ray_gpu_ids"] == []
    finally:
        remove_groups(formed)


def test_noset_variable_name_is_rays():
    from ray._private.accelerators import nvidia_gpu

    assert nvidia_gpu.NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR == NOSET_CUDA_VISIBLE_DEVICES_ENV
