"""The environment a planned rank runs with: its one visible GPU, the RDMA HCAs (InfiniBand or
RoCE) nearest its GPUs for groups that span nodes, and the socket interface of its node. Pure
functions of the plan and the node's topology."""

from __future__ import annotations

from typing import Iterable, Optional

from parallel.grouping import DeviceKind, PlannedGroup
from parallel.topology import NodeTopology


def nearest_hcas(node: NodeTopology, gpu_indices: Iterable[int]) -> list[str]:
    """`device:port` of the node's fabric ports (`NodeTopology.fabric`: IB, else RoCE) nearest
    the given GPUs (by the NICs' link classes in the topology matrix); every one of them when the
    matrix does not name the HCAs."""
    _, active = node.fabric()
    nics = [nic for nic in node.nics if nic.name in {port.device for port in active}]
    chosen = {port.device for port in active}
    if nics:
        chosen = set()
        for index in gpu_indices:
            position = node.gpu_topology.position_of(index)
            best = max(nic.gpu_links[position] for nic in nics)
            chosen |= {nic.name for nic in nics if nic.gpu_links[position] == best}
    return [f"{port.device}:{port.port}" for port in active if port.device in chosen]


def rank_env(group: PlannedGroup, rank: int, node: NodeTopology,
             socket_ifname: Optional[str] = None) -> dict[str, str]:
    """Environment for rank `rank` of `group`, which runs on `node`: its one visible GPU (in
    nvidia-smi's PCI order), NCCL_IB_HCA for groups that span nodes, and the socket interface
    for NCCL and gloo: `socket_ifname` when given, else the one the node's probe found."""
    if not 0 <= rank < len(group.ranks):
        raise ValueError(f"rank {rank} is not in a group of {len(group.ranks)}")
    placement = group.ranks[rank]
    if placement.node != node.name:
        raise ValueError(f"rank {rank} runs on {placement.node}, not on {node.name}")
    env: dict[str, str] = {}
    if group.device_kind is DeviceKind.CUDA:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(placement.device)
        hcas = nearest_hcas(node, group.devices_on(node.name)) if group.spans_nodes else []
        if hcas:
            env["NCCL_IB_HCA"] = "=" + ",".join(hcas)  # '=': exact names, mlx5_1 is not mlx5_10
    socket_ifname = socket_ifname or node.socket_ifname
    if socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
    return env
