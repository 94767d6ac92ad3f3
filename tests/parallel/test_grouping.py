"""The pure grouping on synthetic clusters and plan invariants (the rank environment:
test_rank_env.py)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from typing import Callable, Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.grouping import DeviceKind, PlacementPlan, plan_groups
from parallel.rank_env import rank_env
from parallel.topology import (
    Gpu,
    GpuIndex,
    GpuTopology,
    IBPort,
    LinkClass,
    Nic,
    NodeName,
    NodeTopology,
)

# --------------------------------------------------------------------------- cluster builders


def gpu_topology(num_gpus: int, link: Callable[[int, int], str],
                 numa: Callable[[int], int] = lambda i: 0,
                 nic_links: Sequence[Sequence[str]] = ()) -> GpuTopology:
    return GpuTopology(
        gpus=tuple(Gpu(GpuIndex(i), numa_node=numa(i)) for i in range(num_gpus)),
        links=tuple(tuple(None if i == j else LinkClass.parse(link(min(i, j), max(i, j)))
                          for j in range(num_gpus)) for i in range(num_gpus)),
        nics=tuple(Nic(f"mlx5_{k}", f"NIC{k}", tuple(LinkClass.parse(x) for x in row))
                   for k, row in enumerate(nic_links)),
    )


def ib_ports(rates: Sequence[float], down: Sequence[int] = (),
             link_layer: str = "InfiniBand") -> tuple[IBPort, ...]:
    return tuple(IBPort(f"mlx5_{k}", 1, "DOWN" if k in down else "ACTIVE",
                        "Disabled" if k in down else "LinkUp", rate, link_layer)
                 for k, rate in enumerate(rates))


def node(name: str, topology: GpuTopology, rates: Sequence[float] = (400.0,) * 8,
         down: Sequence[int] = (), unhealthy: Sequence[int] = (),
         link_layer: str = "InfiniBand") -> NodeTopology:
    gpus = tuple(dataclasses.replace(gpu, is_healthy=gpu.index not in unhealthy)
                 for gpu in topology.gpus)
    return NodeTopology(NodeName(name), dataclasses.replace(topology, gpus=gpus),
                        ib_ports(rates, down, link_layer), num_cpu_cores=64, num_numa_nodes=2)


def dgx(name: str, rate: float = 400.0, **kwargs) -> NodeTopology:
    """8 GPUs, every pair NV18, NIC k on GPU k's PCIe switch, 8 HCAs."""
    nic_links = [["PIX" if g == k else "NODE" for g in range(8)] for k in range(8)]
    return node(name, gpu_topology(8, lambda i, j: "NV18", nic_links=nic_links),
                rates=kwargs.pop("rates", (rate,) * 8), **kwargs)


def pcie_box(name: str, numa_of: Callable[[int], int] = lambda i: i // 4) -> NodeTopology:
    """8 PCIe GPUs on two NUMA nodes; two GPUs per switch (same NUMA, consecutive by position)."""
    by_numa = {g: sorted(i for i in range(8) if numa_of(i) == numa_of(g)) for g in range(8)}

    def link(i: int, j: int) -> str:
        if numa_of(i) != numa_of(j):
            return "SYS"
        same_switch = by_numa[i].index(i) // 2 == by_numa[j].index(j) // 2
        return "PIX" if same_switch else "NODE"

    return node(name, gpu_topology(8, link, numa=numa_of))


def asymmetric(name: str) -> NodeTopology:
    """Two NVLink islands of different sizes: GPUs 0-4 (NV12) and 5-7 (NV6), SYS across."""
    def link(i: int, j: int) -> str:
        if j <= 4:
            return "NV12"
        return "NV6" if i >= 5 else "SYS"

    return node(name, gpu_topology(8, link))


def cpu_node(name: str, cores: int = 2) -> NodeTopology:
    return NodeTopology(NodeName(name), num_cpu_cores=cores, num_numa_nodes=1)


def groups_of(plan: PlacementPlan) -> list[list[tuple[str, int]]]:
    return [[(rank.node, rank.device) for rank in group.ranks] for group in plan.groups]


# --------------------------------------------------------------------------- DGX-like nodes


@pytest.mark.parametrize("tp, expected", [
    (2, [[("a", 0), ("a", 1)], [("a", 2), ("a", 3)], [("a", 4), ("a", 5)], [("a", 6), ("a", 7)],
         [("b", 0), ("b", 1)], [("b", 2), ("b", 3)], [("b", 4), ("b", 5)], [("b", 6), ("b", 7)]]),
    (4, [[("a", i) for i in range(4)], [("a", i) for i in range(4, 8)],
         [("b", i) for i in range(4)], [("b", i) for i in range(4, 8)]]),
    (8, [[("a", i) for i in range(8)], [("b", i) for i in range(8)]]),
    (16, [[("a", i) for i in range(8)] + [("b", i) for i in range(8)]]),
])
def test_dgx_pair(tp, expected):
    plan = plan_groups([dgx("b"), dgx("a")], tp)
    assert groups_of(plan) == expected
    assert plan.left_out == () and plan.device_kind is DeviceKind.CUDA
    assert all(str(group.link) == "NV18" for group in plan.groups)
    assert all(group.spans_nodes == (tp == 16) for group in plan.groups)


def test_dgx_tp16_on_four_nodes_pairs_them():
    plan = plan_groups([dgx(name) for name in "abcd"], 16)
    assert [group.node_names for group in plan.groups] == [("a", "b"), ("c", "d")]
    assert all(group.fabric_gbps == 400 for group in plan.groups)
    assert "spans 2 nodes over IB at 400 Gb/s, 8 rank(s) on each" in plan.groups[0].reason


def test_number_of_groups_takes_the_best_and_says_what_is_left():
    plan = plan_groups([dgx("a"), dgx("b")], 8, num_groups=1)
    assert groups_of(plan) == [[("a", i) for i in range(8)]]
    (left,) = plan.left_out
    assert (left.node, left.devices) == ("b", tuple(range(8)))
    assert "not needed: 1 group(s) requested" in left.reason


# --------------------------------------------------------------------------- PCIe boxes


def test_pcie_box_tp4_stays_inside_each_numa_island():
    plan = plan_groups([pcie_box("p")], 4)
    assert groups_of(plan) == [[("p", i) for i in range(4)], [("p", i) for i in range(4, 8)]]
    assert [str(group.link) for group in plan.groups] == ["NODE", "NODE"]
    assert "one NUMA node" in plan.groups[0].reason


def test_pcie_box_tp2_pairs_gpus_under_one_switch():
    plan = plan_groups([pcie_box("p")], 2)
    assert groups_of(plan) == [[("p", 2 * k), ("p", 2 * k + 1)] for k in range(4)]
    assert {str(group.link) for group in plan.groups} == {"PIX"}


def test_pcie_box_with_interleaved_numa_follows_topology_not_indices():
    plan = plan_groups([pcie_box("p", numa_of=lambda i: i % 2)], 4)
    assert groups_of(plan) == [[("p", i) for i in (0, 2, 4, 6)], [("p", i) for i in (1, 3, 5, 7)]]


def test_pcie_box_tp8_has_to_cross_numa():
    (group,) = plan_groups([pcie_box("p")], 8).groups
    assert str(group.link) == "SYS" and "across NUMA nodes" in group.reason


# --------------------------------------------------------------------------- asymmetric NVLink


def test_asymmetric_islands_tp4_takes_the_big_island_first():
    plan = plan_groups([asymmetric("x")], 4)
    assert groups_of(plan) == [[("x", i) for i in range(4)], [("x", i) for i in range(4, 8)]]
    assert [str(group.link) for group in plan.groups] == ["NV12", "SYS"]


def test_asymmetric_islands_one_group_avoids_the_mixed_one():
    plan = plan_groups([asymmetric("x")], 4, num_groups=1)
    assert groups_of(plan) == [[("x", i) for i in range(4)]]
    assert plan.left_out[0].devices == (4, 5, 6, 7)


def test_asymmetric_islands_tp2_uses_each_island_before_crossing():
    plan = plan_groups([asymmetric("x")], 2)
    assert groups_of(plan) == [[("x", 0), ("x", 1)], [("x", 2), ("x", 3)],
                               [("x", 5), ("x", 6)], [("x", 4), ("x", 7)]]
    assert [str(group.link) for group in plan.groups] == ["NV12", "NV12", "NV6", "SYS"]


def test_tp3_leaves_the_remainder_out_with_a_reason():
    plan = plan_groups([asymmetric("x")], 3)
    assert groups_of(plan)[:2] == [[("x", 0), ("x", 1), ("x", 2)], [("x", 5), ("x", 6), ("x", 7)]]
    assert plan.left_out[0].devices == (3, 4)
    assert "left over after 2 group(s) of 3" in plan.left_out[0].reason


# --------------------------------------------------------------------------- IB, ports, health


def test_spanning_uses_only_nodes_with_equal_active_ib():
    nodes = [dgx("a"), dgx("b"), dgx("c", rate=200), dgx("d", down=range(8)),
             dgx("e", rates=(400,) * 7 + (200,)), dgx("f", unhealthy=[3]),
             dgx("g", down=[0, 1])]  # two ports down, the other six active at 400: fine
    plan = plan_groups(nodes, 16)
    assert [group.node_names for group in plan.groups] == [("a", "b")]
    reasons = {(item.node, item.devices): item.reason for item in plan.left_out}
    eight = tuple(range(8))
    assert "needs 2 nodes like this one (8 usable GPUs, IB at 400 Gb/s)" in reasons["g", eight]
    assert "(8 usable GPUs, IB at 200 Gb/s)" in reasons["c", eight]
    assert "no active InfiniBand or RoCE port (8 RDMA port(s) down or inactive)" in reasons[
        "d", eight]
    assert "mixed rates (200, 400 Gb/s)" in reasons["e", eight]
    assert reasons["f", (3,)] == "unhealthy GPU(s)"
    assert reasons["f", (0, 1, 2, 4, 5, 6, 7)] == (
        "TP 16 needs 4 nodes like this one (7 usable GPUs, IB at 400 Gb/s) with 4 rank(s) on "
        "each; there are 1")
    assert len(reasons) == 6


def test_roce_nodes_span_over_roce_and_never_with_ib_nodes():
    # RoCE-only nodes were refused ("no active InfiniBand port") though NCCL runs over RoCE.
    roce = [dgx(n, rate=400, link_layer="Ethernet") for n in "ab"]
    (group,) = plan_groups(roce, 16).groups
    assert group.node_names == ("a", "b") and group.fabric_gbps == 400.0
    assert "spans 2 nodes over RoCE at 400 Gb/s" in group.reason
    env = rank_env(group, 8, roce[1])
    assert env["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{k}:1" for k in range(8))
    # an IB node and a RoCE node at the same rate cannot share a group
    plan = plan_groups([dgx("c"), dgx("d"), roce[0]], 16)
    assert [group.node_names for group in plan.groups] == [("c", "d")]
    (left,) = plan.left_out
    assert "needs 2 nodes like this one (8 usable GPUs, RoCE at 400 Gb/s)" in left.reason


def test_a_node_with_ib_keeps_its_roce_port_out_of_spanning_groups():
    # The A100 fixture's shape: eight IB ports and an Ethernet one (front-end or storage).
    front_end = IBPort("mlx5_8", 1, "ACTIVE", "LinkUp", 100.0, "Ethernet")
    a, b = (dataclasses.replace(dgx(n), ib_ports=dgx(n).ib_ports + (front_end,)) for n in "ab")
    (group,) = plan_groups([a, b], 16).groups
    assert group.fabric_gbps == 400.0 and "over IB at 400 Gb/s" in group.reason
    assert "mlx5_8" not in rank_env(group, 0, a)["NCCL_IB_HCA"]


def test_nodes_at_another_rate_form_their_own_groups():
    plan = plan_groups([dgx("a", 200), dgx("b", 400), dgx("c", 200), dgx("d", 400)], 16)
    assert [(group.node_names, group.fabric_gbps) for group in plan.groups] == [
        (("b", "d"), 400.0), (("a", "c"), 200.0)]


def test_a_node_with_fewer_healthy_gpus_is_not_mixed_in():
    plan = plan_groups([dgx("a", unhealthy=[7]), dgx("b"), dgx("c")], 16)
    assert [group.node_names for group in plan.groups] == [("b", "c")]
    plan = plan_groups([dgx("a", unhealthy=[7]), dgx("b", unhealthy=[2])], 14)
    (group,) = plan.groups  # two 7-GPU nodes of one class: 7 ranks on each
    assert [len(group.devices_on(n)) for n in group.node_names] == [7, 7]
    assert 2 not in group.devices_on("b") and 7 not in group.devices_on("a")


def test_tp_that_fits_a_node_never_spans_even_if_small_nodes_could():
    small = node("s", gpu_topology(2, lambda i, j: "NV4"))
    plan = plan_groups([dgx("a"), small, dataclasses.replace(small, name=NodeName("t"))], 4)
    assert all(group.node_names == ("a",) for group in plan.groups)
    assert "2 usable GPUs, fewer than TP 4; TP fits inside a node with 8" in plan.left_out[0].reason


# --------------------------------------------------------------------------- no valid grouping


@pytest.mark.parametrize("nodes, tp, groups, words", [
    ([dgx("a")], 16, None, "TP 16 needs 2 nodes like this one (8 usable GPUs"),
    ([dgx("a"), dgx("b")], 32, None, "TP 32 needs 4 nodes"),
    ([dgx("a"), dgx("b", down=range(8))], 16, None, "b [0, 1, 2, 3, 4, 5, 6, 7]: no active"),
    ([dgx("a"), dgx("b", rate=200)], 16, None, "any group requested, 0 possible"),
    ([dgx("a"), dgx("b")], 8, 3, "3 group(s) requested, 2 possible. every usable device"),
    ([pcie_box("p")], 9, None, "no valid grouping of TP 9"),
])
def test_no_valid_grouping_is_a_clear_error(nodes, tp, groups, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        plan_groups(nodes, tp, groups)


@pytest.mark.parametrize("kwargs, words", [
    (dict(nodes=[], tp_size=2), "no nodes to plan on"),
    (dict(nodes=[dgx("a"), dgx("a")], tp_size=2), "node names must be unique"),
    (dict(nodes=[dgx("a")], tp_size=0), "tp_size must be a positive integer, got 0"),
    (dict(nodes=[dgx("a")], tp_size=2, num_groups=0), "num_groups must be a positive"),
])
def test_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words):
        plan_groups(**kwargs)


# --------------------------------------------------------------------------- CPU-only clusters


def test_cpu_cluster_groups_inside_nodes_then_spans_over_tcp():
    nodes = [cpu_node("a"), cpu_node("b")]
    plan = plan_groups(nodes, 2)
    assert plan.device_kind is DeviceKind.CPU
    assert groups_of(plan) == [[("a", 0), ("a", 1)], [("b", 0), ("b", 1)]]
    (group,) = plan_groups(nodes, 4).groups
    assert group.node_names == ("a", "b") and "TCP (gloo)" in group.reason
    plan = plan_groups(nodes, 2, cpu_ranks_per_node=1)
    assert groups_of(plan) == [[("a", 0), ("b", 0)]]


def test_gpu_plan_leaves_cpu_only_nodes_out():
    plan = plan_groups([dgx("a"), cpu_node("c")], 8)
    assert groups_of(plan) == [[("a", i) for i in range(8)]]
    assert plan.left_out[0].node == "c" and "no GPUs" in plan.left_out[0].reason


def test_plan_json_shape():
    data = plan_groups([pcie_box("p")], 4, num_groups=1).to_dict()
    assert data["groups"] == [[{"node": "p", "device": i} for i in range(4)]]
    assert data["explanation"][0].startswith("group 0: p GPUs [0, 1, 2, 3]: inside one node")
    assert data["left_out"] == [{"node": "p", "devices": [4, 5, 6, 7],
                                 "reason": "not needed: 1 group(s) requested"}]


# --------------------------------------------------------------------------- properties

LINK_NAMES = ["NV12", "NV6", "PIX", "PXB", "PHB", "NODE", "SYS"]


@st.composite
def random_node(draw, name: str) -> NodeTopology:
    num_gpus = draw(st.integers(0, 8))
    pairs = list(itertools.combinations(range(num_gpus), 2))
    chosen = draw(st.lists(st.sampled_from(LINK_NAMES), min_size=len(pairs), max_size=len(pairs)))
    by_pair = dict(zip(pairs, chosen, strict=True))
    rates = draw(st.lists(st.sampled_from([200.0, 400.0]), max_size=3))
    down = draw(st.lists(st.integers(0, 2), max_size=2))
    unhealthy = draw(st.lists(st.integers(0, 7), max_size=2))
    link_layer = draw(st.sampled_from(["InfiniBand", "Ethernet"]))
    return node(name, gpu_topology(num_gpus, lambda i, j: by_pair[(i, j)]), rates, down, unhealthy,
                link_layer)


@st.composite
def random_cluster(draw) -> list[NodeTopology]:
    num_nodes = draw(st.integers(1, 4))
    return [draw(random_node(f"n{k}")) for k in range(num_nodes)]


def _usable(nodes: list[NodeTopology]) -> set[tuple[str, int]]:
    if all(not n.gpus for n in nodes):  # a CPU plan: one slot per core
        return {(n.name, slot) for n in nodes for slot in range(n.num_cpu_cores)}
    return {(n.name, g.index) for n in nodes for g in n.gpus if g.is_healthy}


def _check_plan(nodes: list[NodeTopology], tp: int, plan: PlacementPlan) -> None:
    by_name = {n.name: n for n in nodes}
    placed = [(r.node, r.device) for g in plan.groups for r in g.ranks]
    left = [(item.node, d) for item in plan.left_out for d in item.devices]
    unhealthy = {(n.name, g.index) for n in nodes for g in n.gpus if not g.is_healthy}
    # Every device is accounted for exactly once: in a group or left out with a reason.
    assert Counter(placed + left) == Counter(list(_usable(nodes)) + list(unhealthy))
    assert set(placed) <= set(_usable(nodes))
    largest = max((sum(g.is_healthy for g in n.gpus) for n in nodes), default=0)
    for group in plan.groups:
        assert len(group.ranks) == tp
        counts = {len(group.devices_on(name)) for name in group.node_names}
        assert len(counts) == 1  # the same number of ranks on every node
        if tp <= largest:
            assert not group.spans_nodes
        if group.spans_nodes:
            members = [by_name[name] for name in group.node_names]
            rates = {p.rate_gbps for n in members for p in n.fabric()[1]}
            assert rates == {group.fabric_gbps}
            assert len({n.fabric()[0] for n in members}) == 1  # IB and RoCE never mixed
            assert len({sum(g.is_healthy for g in n.gpus) for n in members}) == 1
        for name in group.node_names:
            if group.device_kind is DeviceKind.CPU:
                continue
            topology = by_name[name].gpu_topology
            positions = [topology.position_of(d) for d in group.devices_on(name)]
            for i, j in itertools.combinations(positions, 2):
                assert group.link is not None and topology.link(i, j) >= group.link


@settings(max_examples=150, deadline=None)
@given(random_cluster(), st.sampled_from([1, 2, 3, 4, 8, 16]),
       st.one_of(st.none(), st.integers(1, 3)))
def test_every_plan_is_disjoint_symmetric_and_accounted_for(nodes, tp, num_groups):
    try:
        plan = plan_groups(nodes, tp, num_groups)
    except ValueError as exc:
        assert f"TP {tp}" in str(exc)
        return
    _check_plan(nodes, tp, plan)
    assert num_groups is None or len(plan.groups) == num_groups


@settings(max_examples=60, deadline=None)
@given(random_node("n"), st.sampled_from([2, 3, 4]))
def test_a_node_first_group_is_as_fast_as_any_clique(topology, tp):
    """The first group's weakest link equals the best weakest link over all tp-cliques."""
    healthy = [i for i, g in enumerate(topology.gpus) if g.is_healthy]
    if len(healthy) < tp:
        return
    best: Optional[LinkClass] = max(
        min(topology.gpu_topology.link(i, j) for i, j in itertools.combinations(c, 2))
        for c in itertools.combinations(healthy, tp))
    plan = plan_groups([topology], tp)
    assert plan.groups[0].link == best


def test_gpu_budget_keeps_the_best_subgroup_and_says_why():
    """A node whose cluster manager offers 2 of its 8 NV18 GPUs gives one group, not four."""
    from parallel.topology_parse import parse_nvidia_smi_topo
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data" / "topology"
    h100 = parse_nvidia_smi_topo((data / "nvidia-smi-topo_h100x8_nv18_12nic.txt").read_text())
    pcie = parse_nvidia_smi_topo((data / "nvidia-smi-topo_pcie2_phb.txt").read_text())
    nodes = [NodeTopology(NodeName("a"), pcie), NodeTopology(NodeName("b"), h100)]
    plan = plan_groups(nodes, 2, gpu_budget={NodeName("b"): 2, NodeName("a"): 2})
    assert [[(r.node, r.device) for r in g.ranks] for g in plan.groups] == [
        [("b", 0), ("b", 1)], [("a", 0), ("a", 1)]]
    assert str(plan.groups[0].link) == "NV18" and str(plan.groups[1].link) == "PHB"
    (cut,) = plan.left_out
    assert cut.node == "b" and cut.devices == (2, 3, 4, 5, 6, 7)
    assert "offers 2 GPU(s)" in cut.reason
    assert len(plan_groups(nodes, 2).groups) == 5
