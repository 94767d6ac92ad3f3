"""The allocator's policy and `tpserve status`'s report, on plain inputs (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.app import ServeConfig, group_placement_options, group_resources, planned_placement
from cluster.groups.claims import (
    Claim,
    beyond_plan_message,
    claim,
    compute_device,
    plan_summary,
    rank_torch_device,
    render_status,
    status_report,
)
from cluster.groups.rank_actor import rank_device
from parallel.grouping import DeviceKind, plan_groups
from parallel.topology import NodeName, NodeTopology
from parallel.topology_parse import parse_nvidia_smi_topo
from workers.config import EngineConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "topology"


def _plan():
    h100 = parse_nvidia_smi_topo((DATA / "nvidia-smi-topo_h100x8_nv18_12nic.txt").read_text())
    pcie = parse_nvidia_smi_topo((DATA / "nvidia-smi-topo_pcie2_phb.txt").read_text())
    return plan_groups([NodeTopology(NodeName("a"), pcie), NodeTopology(NodeName("b"), h100)],
                       2, gpu_budget={NodeName("b"): 2})


def test_claims_go_in_plan_order_and_come_back():
    claims: dict = {}
    assert claim(2, claims, "r1") == 0
    claims[0] = Claim(0, "r1", 0.0)
    assert claim(2, claims, "r1") == 0  # asking again: the same group
    assert claim(2, claims, "r2") == 1
    claims[1] = Claim(1, "r2", 1.0)
    assert claim(2, claims, "r3") is None  # beyond the plan
    del claims[0]  # r1 died or scaled down
    assert claim(2, claims, "r3") == 0


def test_a_group_on_a_node_that_left_is_never_handed_out():
    # Its placement group could never be ready: each replica would claim it, time out and
    # fail, and the next replica claim the same group again.
    assert claim(3, {}, "r1", unavailable={0}) == 1
    assert claim(3, {1: Claim(1, "r1", 0.0)}, "r2", unavailable={0, 2}) is None
    assert claim(3, {}, "r1", unavailable=set()) == 0


def test_beyond_plan_message_names_replica_and_holders():
    plan = _plan()
    message = beyond_plan_message("r3", plan, {0: Claim(0, "r1", 0), 1: Claim(1, "r2", 0)})
    assert "replica r3 has no planned group" in message
    assert "2 group(s) of TP 2" in message and "['r1', 'r2']" in message


@pytest.mark.parametrize("engine, kind, want", [
    ("auto", DeviceKind.CUDA, "cuda"), ("cuda", DeviceKind.CUDA, "cuda"),
    ("cpu", DeviceKind.CUDA, "cpu"), ("auto", DeviceKind.CPU, "cpu"), ("cpu", DeviceKind.CPU, "cpu"),
])
def test_compute_device_is_explicit(engine, kind, want):
    assert compute_device(engine, kind) == want


def test_compute_device_refuses_what_cannot_be():
    with pytest.raises(ValueError, match="found no GPU"):
        compute_device("cuda", DeviceKind.CPU)
    with pytest.raises(ValueError, match="'tpu'"):
        compute_device("tpu", DeviceKind.CUDA)


def test_rank_devices_under_the_plans_visible_gpu():
    assert rank_torch_device("cuda") == "cuda:0" and rank_torch_device("cpu") == "cpu"
    assert rank_device("cuda:1") == "cuda:0" and rank_device("cpu") == "cpu"


def test_plan_summary_and_status_report():
    plan = plan_summary(_plan())
    assert plan["groups"] == [[{"node": "b", "device": 0}, {"node": "b", "device": 1}],
                              [{"node": "a", "device": 0}, {"node": "a", "device": 1}]]
    assert [link["link"] for link in plan["links"]] == ["NV18", "PHB"]
    ranks = [{"node": "b", "device": "0", "pid": 11}, {"node": "b", "device": "1", "pid": 12}]
    report = status_report(
        plan, [{"group": 0, "replica": "r1", "since": 0.0}],
        [{"replica": "r3", "time": 0.0, "message": "replica r3 has no planned group"}],
        {"r1": {"ranks": ranks, "planned_group": 0, "kv_usage": 0.25, "running": 2,
                "waiting": 1}},
        {"status": "HEALTHY", "message": ""})
    assert report["groups"] == [{"replica": "r1", "planned_group": 0, "ranks": ranks,
                                 "kv_usage": 0.25, "running": 2, "waiting": 1}]
    assert report["unclaimed_groups"] == [1] and report["placement"] == "plan"
    assert report["errors"] == ["replica r3 has no planned group"]
    text = render_status(report)
    assert "replica r1 (planned group 0): kv 25%, running 2, waiting 1" in text
    assert "rank 1: node b device 1 pid 12" in text and "error: replica r3" in text
    assert "unclaimed planned groups: [1]" in text


def test_status_without_a_plan():
    report = status_report(None, [], [], {}, None)
    assert report["placement"] == "serve" and report["unclaimed_groups"] == []
    assert "Serve places each group" in render_status(report)


def test_placement_choice_follows_the_cluster():
    config = ServeConfig(engine=EngineConfig(model="default", tp_size=2))
    cpu, gpu = {"CPU": 2.0}, {"CPU": 16.0, "GPU": 8.0}
    assert planned_placement(config, cpu, group_resources(config, cpu)) is None
    planned = planned_placement(config, gpu, group_resources(config, gpu))
    assert planned.formation.tp_size == 2 and planned.formation.cpus_per_rank == 1.0
    forced = ServeConfig(engine=config.engine, placement="plan", cpu_ranks_per_node=1)
    assert planned_placement(forced, cpu, group_resources(forced, cpu)).formation \
        .cpu_ranks_per_node == 1
    options = group_placement_options(group_resources(config, gpu), 2, "PACK", planned)
    assert options == {"ray_actor_options": {"num_cpus": 0, "num_gpus": 0}}
    options = group_placement_options(group_resources(config, cpu), 2, "PACK", None)
    assert len(options["placement_group_bundles"]) == 2
    with pytest.raises(ValueError, match="--placement must be"):
        ServeConfig(engine=config.engine, placement="random")


def test_an_autoscaled_deployment_is_placed_by_serve_where_the_autoscaler_sees_it():
    # A planned replica asks Ray for nothing: with the plan full, no demand reaches the
    # autoscaler and no GPU node is ever added. Serve's placement groups are demand it sees.
    gpu = {"CPU": 16.0, "GPU": 8.0}
    engine = EngineConfig(model="default", tp_size=2)
    autoscaled = ServeConfig(engine=engine, min_groups=1, max_groups=4)
    assert planned_placement(autoscaled, gpu, group_resources(autoscaled, gpu)) is None
    fixed = ServeConfig(engine=engine, min_groups=4, max_groups=4)
    assert planned_placement(fixed, gpu, group_resources(fixed, gpu)) is not None
    forced = ServeConfig(engine=engine, min_groups=1, max_groups=4, placement="plan")
    assert planned_placement(forced, gpu, group_resources(forced, gpu)) is not None


def test_a_node_where_ray_counts_gpus_the_probe_did_not_see_is_refused_by_name():
    # The probe's tools were missing (no nvidia-ml-py, nvidia-smi off the PATH): a CPU plan
    # would run the GPU cluster's ranks on CPU without a word.
    from cluster.groups.formation import FormationConfig, plan_placement

    blind = NodeTopology(NodeName("gpu-node"), num_cpu_cores=8)
    with pytest.raises(ValueError, match=r"Ray counts GPUs on node\(s\) gpu-node \(4 GPU"):
        plan_placement({blind.name: blind}, FormationConfig(tp_size=2), {blind.name: 4})
    plan = plan_placement({blind.name: blind}, FormationConfig(tp_size=2), {blind.name: 0})
    assert plan.device_kind is DeviceKind.CPU and len(plan.groups) == 4


def test_the_placement_strategy_of_serve_placed_groups_is_an_option():
    # It was a field no option reached: every Serve-placed group PACKed, free to span nodes.
    gpu = {"CPU": 16.0, "GPU": 8.0}
    engine = EngineConfig(model="default", tp_size=2)
    strict = ServeConfig(engine=engine, min_groups=1, max_groups=4,
                         placement_strategy="STRICT_PACK")
    resources = group_resources(strict, gpu)
    assert planned_placement(strict, gpu, resources) is None
    options = group_placement_options(resources, 2, strict.placement_strategy, None)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    with pytest.raises(ValueError, match="--placement-strategy must be one of PACK, "
                                         "STRICT_PACK, SPREAD, STRICT_SPREAD, got 'pack'"):
        ServeConfig(engine=engine, placement_strategy="pack")
    with pytest.raises(ValueError, match="--placement-strategy places the ranks of groups "
                                         "Serve places; --placement plan places them itself"):
        ServeConfig(engine=engine, placement="plan", placement_strategy="SPREAD")
    # auto chooses the plan for a fixed number of groups on GPUs: a strategy there is refused
    fixed = ServeConfig(engine=engine, min_groups=2, max_groups=2, placement_strategy="SPREAD")
    with pytest.raises(ValueError, match="--placement auto chose the topology plan"):
        planned_placement(fixed, gpu, group_resources(fixed, gpu))
