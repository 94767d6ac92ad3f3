"""Which devices of which nodes form each TP group, and why: a pure function of the topologies.

The rules, in the order they decide:

1. A group stays inside one node whenever TP fits in a node (some node has TP usable devices);
   nodes with fewer are left out rather than joined across the network.
2. Inside a node, groups form at the fastest link class first: NVLink islands (more links first),
   then GPUs under one PCIe switch (PIX, PXB), one host bridge (PHB), one NUMA node (NODE), and
   SYS last. Each group's GPUs all share a link of that class or better (a clique, not a chain).
3. When TP exceeds every node, a group spans nodes with the same number of ranks on each. GPU
   nodes take part only over RDMA: InfiniBand, or RoCE on nodes without an active IB port
   (`NodeTopology.fabric`), every active port of that fabric at one rate, and only with nodes of
   the same fabric, the same rate and the same number of healthy GPUs (a node that lost a GPU is
   not mixed in). CPU-only clusters span over TCP (gloo), so the fabric rule does not apply.

Every usable device ends up either in a group or in `left_out` with the reason.
"""

from __future__ import annotations

import enum
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from parallel.topology import LinkClass, LinkKind, NodeName, NodeTopology

_LINK_MEANING = {
    LinkKind.NV: "NVLink", LinkKind.PIX: "one PCIe switch", LinkKind.PXB: "PCIe switches",
    LinkKind.PHB: "one host bridge", LinkKind.NODE: "one NUMA node",
    LinkKind.SYS: "across NUMA nodes",
}


class DeviceKind(str, enum.Enum):
    CUDA = "cuda"
    CPU = "cpu"

    @property
    def unit(self) -> str:
        return "GPUs" if self is DeviceKind.CUDA else "CPU slots"


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs: a node and a device index on it (a GPU index, or a CPU slot)."""

    node: NodeName
    device: int


@dataclass(frozen=True)
class PlannedGroup:
    """One TP group: `ranks[k]` is where rank k runs."""

    ranks: tuple[RankPlacement, ...]
    device_kind: DeviceKind
    link: Optional[LinkClass]  # weakest link between two ranks on one node; None if there is none
    fabric_gbps: Optional[float]  # RDMA rate between its nodes when it spans GPU nodes
    reason: str

    @property
    def node_names(self) -> tuple[NodeName, ...]:
        return tuple(dict.fromkeys(rank.node for rank in self.ranks))

    @property
    def spans_nodes(self) -> bool:
        return len(self.node_names) > 1

    def devices_on(self, node: NodeName) -> tuple[int, ...]:
        return tuple(rank.device for rank in self.ranks if rank.node == node)


@dataclass(frozen=True)
class LeftOut:
    node: NodeName
    devices: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class PlacementPlan:
    tp_size: int
    device_kind: DeviceKind
    groups: tuple[PlannedGroup, ...]
    left_out: tuple[LeftOut, ...]
    warnings: tuple[str, ...] = ()  # "<node>: <what a probe tool could not read>"

    def explanation(self) -> list[str]:
        lines = [f"group {k}: {group.reason}" for k, group in enumerate(self.groups)]
        lines += [f"left out {item.node} {self.device_kind.unit} {list(item.devices)}: "
                  f"{item.reason}" for item in self.left_out]
        return lines + [f"warning: {warning}" for warning in self.warnings]

    def to_dict(self) -> dict:
        """The JSON shape of `tpserve topology plan`."""
        return {
            "tp": self.tp_size,
            "device_kind": self.device_kind.value,
            "groups": [[{"node": rank.node, "device": rank.device} for rank in group.ranks]
                       for group in self.groups],
            "explanation": self.explanation(),
            "left_out": [{"node": item.node, "devices": list(item.devices), "reason": item.reason}
                         for item in self.left_out],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class _Host:
    """A node as grouping sees it: its usable devices and the link between two of them."""

    topology: NodeTopology
    devices: tuple[int, ...]
    kind: DeviceKind

    @property
    def name(self) -> NodeName:
        return self.topology.name

    def link(self, a: int, b: int) -> Optional[LinkClass]:
        if self.kind is DeviceKind.CPU:
            return None
        gpus = self.topology.gpu_topology
        return gpus.link(gpus.position_of(a), gpus.position_of(b))

    def weakest_link(self, devices: Iterable[int]) -> Optional[LinkClass]:
        links = [self.link(a, b) for a, b in itertools.combinations(devices, 2)]
        return min(links) if links and None not in links else None


Subgroup = tuple[tuple[int, ...], Optional[LinkClass]]


def plan_groups(nodes: Iterable[NodeTopology], tp_size: int, num_groups: Optional[int] = None,
                *, cpu_ranks_per_node: Optional[int] = None,
                gpu_budget: Optional[Mapping[NodeName, int]] = None) -> PlacementPlan:
    """Plan `num_groups` TP groups of `tp_size` ranks (None: as many as fit), best first.

    Ranks go on GPUs when any node has one, else on CPU slots (`cpu_ranks_per_node` per node,
    default its core count). `gpu_budget[node]` caps the GPUs used on a node (the GPUs the
    cluster manager offers there, which can be fewer than the probe found): the best subgroups
    are kept, the rest left out. Raises `ValueError` naming what stands in the way when no valid
    grouping (or fewer than `num_groups`) exists.
    """
    nodes = _checked_nodes(nodes, tp_size, num_groups, cpu_ranks_per_node)
    hosts, left_out = _hosts(nodes, cpu_ranks_per_node)
    hosts, left_out = _within_budget(hosts, tp_size, gpu_budget or {}, left_out)
    kind = DeviceKind.CPU if all(not node.gpus for node in nodes) else DeviceKind.CUDA
    largest = max((len(host.devices) for host in hosts), default=0)
    if tp_size <= largest:
        groups, more = _within_nodes(hosts, tp_size, largest)
    else:
        groups, more = _across_nodes(hosts, tp_size)
    left_out += more
    wanted = len(groups) if num_groups is None else num_groups
    if not groups or len(groups) < wanted:
        raise ValueError(_no_plan_message(tp_size, num_groups, len(groups), left_out))
    for group in groups[wanted:]:
        for node in group.node_names:
            left_out.append(LeftOut(node, group.devices_on(node),
                                    f"not needed: {wanted} group(s) requested"))
    warnings = tuple(f"{node.name}: {warning}" for node in nodes for warning in node.warnings)
    return PlacementPlan(tp_size, kind, tuple(groups[:wanted]), tuple(left_out), warnings)


def _checked_nodes(nodes: Iterable[NodeTopology], tp_size: int, num_groups: Optional[int],
                   cpu_ranks_per_node: Optional[int]) -> list[NodeTopology]:
    nodes = sorted(nodes, key=lambda node: node.name)
    if not nodes:
        raise ValueError("no nodes to plan on: expected at least one node topology")
    names = [node.name for node in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"node names must be unique, got {names}")
    for label, value in (("tp_size", tp_size), ("num_groups", num_groups),
                         ("cpu_ranks_per_node", cpu_ranks_per_node)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    return nodes


def _hosts(nodes: list[NodeTopology], cpu_ranks_per_node: Optional[int]
           ) -> tuple[list[_Host], list[LeftOut]]:
    if all(not node.gpus for node in nodes):
        return [_Host(node, tuple(range(cpu_ranks_per_node or node.num_cpu_cores or 1)),
                      DeviceKind.CPU) for node in nodes], []
    hosts, left_out = [], []
    for node in nodes:
        if not node.gpus:
            left_out.append(LeftOut(node.name, (), "no GPUs; the other nodes have GPUs"))
            continue
        sick = tuple(gpu.index for gpu in node.gpus if not gpu.is_healthy)
        if sick:
            left_out.append(LeftOut(node.name, sick, "unhealthy GPU(s)"))
        healthy = tuple(gpu.index for gpu in node.gpus if gpu.is_healthy)
        if healthy:
            hosts.append(_Host(node, healthy, DeviceKind.CUDA))
    return hosts, left_out


def _within_budget(hosts: list[_Host], tp_size: int, budget: Mapping[NodeName, int],
                   left_out: list[LeftOut]) -> tuple[list[_Host], list[LeftOut]]:
    """Each GPU host cut to its budget: its best subgroups of TP (or of the budget, when TP
    exceeds it) are kept."""
    kept = []
    for host in hosts:
        limit = budget.get(host.name)
        if host.kind is DeviceKind.CPU or limit is None or limit >= len(host.devices):
            kept.append(host)
            continue
        size = min(tp_size, max(limit, 1))
        chosen = [d for devices, _ in _node_subgroups(host, size)[0][:limit // size]
                  for d in devices]
        dropped = tuple(d for d in host.devices if d not in chosen)
        left_out.append(LeftOut(host.name, dropped, (
            f"the cluster offers {limit} GPU(s) on this node; the probe found "
            f"{len(host.devices)}")))
        if chosen:
            kept.append(_Host(host.topology, tuple(sorted(chosen)), host.kind))
    return kept, left_out


def _disjoint_cliques(vertices: list[int], size: int,
                      adjacent: Callable[[int, int], bool]) -> list[tuple[int, ...]]:
    """The most disjoint cliques of `size` (each pair adjacent); the lexicographically first
    such set. Exhaustive with a counting bound: fine for the 8-16 GPUs of a node."""
    best: list[tuple[int, ...]] = []

    def extend(free: tuple[int, ...], chosen: list[tuple[int, ...]]) -> None:
        nonlocal best
        if len(chosen) > len(best):
            best = list(chosen)
        if len(chosen) + len(free) // size <= len(best):
            return
        first, rest = free[0], free[1:]
        neighbours = [v for v in rest if adjacent(first, v)]
        for others in itertools.combinations(neighbours, size - 1):
            if all(adjacent(a, b) for a, b in itertools.combinations(others, 2)):
                extend(tuple(v for v in rest if v not in others), chosen + [(first, *others)])
        extend(rest, chosen)

    if len(vertices) >= size:
        extend(tuple(vertices), [])
    return best


def _node_subgroups(host: _Host, size: int) -> tuple[list[Subgroup], list[int]]:
    """Disjoint subgroups of `size` devices, fastest link class first; and the devices left."""
    free = list(host.devices)
    found: list[Subgroup] = []
    if size > 1 and host.kind is DeviceKind.CUDA:
        classes = sorted({host.link(a, b) for a, b in itertools.combinations(free, 2)},
                         reverse=True)
        for level in classes:
            at_least = lambda a, b, level=level: host.link(a, b) >= level  # noqa: E731
            for clique in _disjoint_cliques(free, size, at_least):
                found.append((clique, host.weakest_link(clique)))
                free = [device for device in free if device not in clique]
    while len(free) >= size:  # CPU slots and TP 1: no links to choose by
        found.append((tuple(free[:size]), host.weakest_link(free[:size])))
        free = free[size:]
    return found, free


def _describe_link(link: Optional[LinkClass], kind: DeviceKind) -> str:
    if kind is DeviceKind.CPU:
        return "CPU ranks on one host (gloo)"
    if link is None:
        return "one GPU"
    return f"every pair {link} or better ({_LINK_MEANING[link.kind]})"


def _within_nodes(hosts: list[_Host], tp_size: int, largest: int
                  ) -> tuple[list[PlannedGroup], list[LeftOut]]:
    groups, left_out = [], []
    for host in hosts:
        unit = host.kind.unit
        if len(host.devices) < tp_size:
            left_out.append(LeftOut(host.name, host.devices, (
                f"{len(host.devices)} usable {unit}, fewer than TP {tp_size}; TP fits inside "
                f"a node with {largest}, so groups do not span nodes")))
            continue
        subgroups, free = _node_subgroups(host, tp_size)
        for devices, link in subgroups:
            ranks = tuple(RankPlacement(host.name, device) for device in devices)
            reason = (f"{host.name} {unit} {list(devices)}: inside one node, "
                      f"{_describe_link(link, host.kind)}")
            groups.append(PlannedGroup(ranks, host.kind, link, None, reason))
        if free:
            left_out.append(LeftOut(host.name, tuple(free), (
                f"left over after {len(subgroups)} group(s) of {tp_size} on this node")))
    groups.sort(key=lambda group: (group.link is not None, group.link or LinkClass(LinkKind.SYS)),
                reverse=True)
    return groups, left_out


def _fabric(host: _Host) -> tuple[str, Optional[float], Optional[str]]:
    """The node's RDMA fabric ("IB", "RoCE") and rate for spanning groups, or the reason it
    cannot span ("TCP (gloo)" for CPU nodes, with no rate)."""
    if host.kind is DeviceKind.CPU:
        return "TCP (gloo)", None, None
    fabric, active = host.topology.fabric()
    if not active:
        inactive = len(host.topology.ib_ports)
        state = f" ({inactive} RDMA port(s) down or inactive)" if inactive else ""
        return "", None, (f"no active InfiniBand or RoCE port{state}: cannot take part in a "
                          "group spanning nodes")
    rates = sorted({port.rate_gbps for port in active})
    if len(rates) > 1:
        listed = ", ".join(f"{rate:g}" for rate in rates)
        return fabric, None, (f"active {fabric} ports at mixed rates ({listed} Gb/s): the "
                              "slowest would pace every all-reduce")
    return fabric, rates[0], None


def _across_nodes(hosts: list[_Host], tp_size: int) -> tuple[list[PlannedGroup], list[LeftOut]]:
    left_out = []
    # Faster fabrics first, and IB before RoCE at one rate.
    classes: dict[tuple[float, int, bool, str], list[_Host]] = defaultdict(list)
    for host in hosts:
        fabric, rate, why_not = _fabric(host)
        if why_not:
            left_out.append(LeftOut(host.name, host.devices, why_not))
        else:
            classes[(rate or 0.0, len(host.devices), fabric == "IB", fabric)].append(host)
    groups = []
    for (rate, _, _, fabric), members in sorted(classes.items(), reverse=True):
        more_groups, more_left = _symmetric_groups(members, tp_size, fabric, rate or None)
        groups += more_groups
        left_out += more_left
    return groups, left_out


def _symmetric_groups(members: list[_Host], tp_size: int, fabric_name: str,
                      rate: Optional[float]) -> tuple[list[PlannedGroup], list[LeftOut]]:
    """Groups over nodes of one kind (device count, fabric and rate), the same ranks on each."""
    num_devices = len(members[0].devices)
    per_node = max(d for d in range(1, num_devices + 1) if tp_size % d == 0)
    num_nodes = tp_size // per_node
    fabric = f"{fabric_name} at {rate:g} Gb/s" if rate else fabric_name
    too_few = (f"TP {tp_size} needs {num_nodes} nodes like this one ({num_devices} usable "
               f"{members[0].kind.unit}, {fabric}) with {per_node} rank(s) on each")
    if len(members) < num_nodes:
        return [], [LeftOut(host.name, host.devices, f"{too_few}; there are {len(members)}")
                    for host in members]
    left_out, subgroups = [], {}
    for host in members:
        subgroups[host.name], free = _node_subgroups(host, per_node)
        if free:
            left_out.append(LeftOut(host.name, tuple(free),
                                    f"left over after subgroups of {per_node} for TP {tp_size}"))
    # One subgroup of every node in turn: any num_nodes consecutive slots are distinct nodes
    # (equal device counts and complete link matrices give every node as many subgroups).
    num_turns = len(subgroups[members[0].name])
    assert all(len(subs) == num_turns for subs in subgroups.values())
    slots = [(host, subgroups[host.name][turn]) for turn in range(num_turns) for host in members]
    usable = len(slots) - len(slots) % num_nodes
    groups = [_spanning_group(slots[start:start + num_nodes], fabric, rate)
              for start in range(0, usable, num_nodes)]
    for host, (devices, _) in slots[usable:]:
        left_out.append(LeftOut(host.name, devices, f"{too_few}; no more such nodes left"))
    return groups, left_out


def _spanning_group(slots: list[tuple[_Host, Subgroup]], fabric: str, rate: Optional[float]
                    ) -> PlannedGroup:
    assert len({host.name for host, _ in slots}) == len(slots), "one subgroup per node"
    kind = slots[0][0].kind
    ranks = tuple(RankPlacement(host.name, device) for host, (devices, _) in slots
                  for device in devices)
    links = [link for _, (_, link) in slots if link is not None]
    link = min(links) if links else None
    parts = ", ".join(f"{host.name} {list(devices)}" for host, (devices, _) in slots)
    reason = (f"spans {len(slots)} nodes over {fabric}, {len(slots[0][1][0])} rank(s) on each "
              f"({parts}); inside each node {_describe_link(link, kind)}")
    return PlannedGroup(ranks, kind, link, rate, reason)


def _no_plan_message(tp_size: int, num_groups: Optional[int], found: int,
                     left_out: list[LeftOut]) -> str:
    wanted = f"{num_groups} group(s)" if num_groups else "any group"
    reasons = "; ".join(f"{item.node} {list(item.devices)}: {item.reason}" for item in left_out)
    if not reasons:
        reasons = "every usable device is in those groups" if found else "no usable device"
    return f"no valid grouping of TP {tp_size}: {wanted} requested, {found} possible. {reasons}"
