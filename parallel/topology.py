"""What one node reports about its GPUs, their links, its NICs and its InfiniBand ports.

Plain frozen dataclasses, filled by the parsers in `parallel.topology_parse` (tool output as text)
and by the probes in `parallel.topology_probe` (this node), and read by the pure grouping in
`parallel.grouping`. Positions, not GPU indices, address the link matrix: `links[i][j]` joins
`gpus[i]` and `gpus[j]` (the indices can have holes when a GPU fell off the bus).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import NewType, Optional

NodeName = NewType("NodeName", str)
GpuIndex = NewType("GpuIndex", int)


class LinkKind(enum.IntEnum):
    """How two devices reach each other, slowest first (as `nvidia-smi topo -m` documents)."""

    SYS = 0  # PCIe plus the SMP interconnect between NUMA nodes (QPI/UPI)
    NODE = 1  # PCIe plus the interconnect between host bridges inside one NUMA node
    PHB = 2  # PCIe through one host bridge (the CPU)
    PXB = 3  # several PCIe bridges, no host bridge
    PIX = 4  # at most one PCIe bridge (the same switch)
    NV = 5  # a bonded set of NVLinks


# Names older drivers printed for the same classes.
_KIND_ALIASES = {"SOC": LinkKind.SYS}
_NV_PATTERN = re.compile(r"NV(\d+)")


@dataclass(frozen=True, order=True)
class LinkClass:
    """One link class; orders by speed (`NV18 > NV12 > PIX > PXB > PHB > NODE > SYS`)."""

    kind: LinkKind
    num_nvlinks: int = 0

    def __post_init__(self) -> None:
        if self.kind is LinkKind.NV and self.num_nvlinks < 1:
            raise ValueError(f"an NVLink class needs at least one link, got {self.num_nvlinks}")
        if self.kind is not LinkKind.NV and self.num_nvlinks != 0:
            raise ValueError(f"{self.kind.name} is not NVLink but has {self.num_nvlinks} links")

    @classmethod
    def parse(cls, text: str) -> "LinkClass":
        """`"NV12"` -> NV with 12 links, `"PIX"` -> PIX; `ValueError` for anything else."""
        token = text.strip().upper()
        match = _NV_PATTERN.fullmatch(token)
        if match:
            return cls(LinkKind.NV, int(match.group(1)))
        if token in _KIND_ALIASES:
            return cls(_KIND_ALIASES[token])
        if token in LinkKind.__members__ and token != "NV":
            return cls(LinkKind[token])
        raise ValueError(f"unknown link class {text.strip()!r}: expected NV<n>, PIX, PXB, PHB, "
                         "NODE or SYS")

    @property
    def is_nvlink(self) -> bool:
        return self.kind is LinkKind.NV

    def __str__(self) -> str:
        return f"NV{self.num_nvlinks}" if self.is_nvlink else self.kind.name


@dataclass(frozen=True)
class Gpu:
    """One GPU as the node sees it. `index` is the NVML / nvidia-smi (PCI bus order) index."""

    index: GpuIndex
    name: Optional[str] = None
    memory_mib: Optional[int] = None
    numa_node: Optional[int] = None
    pci_bus_id: Optional[str] = None
    cpu_affinity: Optional[str] = None  # as the tool prints it, e.g. "0-31,64-95"
    is_healthy: bool = True


@dataclass(frozen=True)
class Nic:
    """A NIC from the topology matrix. `gpu_links[i]` is its link to `gpus[i]` of the node."""

    name: str  # the device (mlx5_0) when the output names it, else its column label (NIC0)
    label: str  # the column label in `nvidia-smi topo -m`
    gpu_links: tuple[LinkClass, ...] = ()


@dataclass(frozen=True)
class IBPort:
    """One port of an InfiniBand HCA, as `ibstat` or /sys/class/infiniband report it."""

    device: str
    port: int
    state: str  # upper case without the numeric code: ACTIVE, DOWN, INIT, ARMED
    phys_state: str  # LinkUp, Polling, Disabled, ...
    rate_gbps: float
    link_layer: str  # InfiniBand or Ethernet (RoCE)

    @property
    def is_active(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state.lower() == "linkup"

    @property
    def is_infiniband(self) -> bool:
        return self.link_layer.lower() == "infiniband"


Links = tuple[tuple[Optional[LinkClass], ...], ...]


@dataclass(frozen=True)
class GpuTopology:
    """GPUs, the link class of every pair (None on the diagonal) and the NICs' links to them."""

    gpus: tuple[Gpu, ...] = ()
    links: Links = ()
    nics: tuple[Nic, ...] = ()
    warnings: tuple[str, ...] = ()  # what the tool said it could not read (a device named)

    def __post_init__(self) -> None:
        num_gpus = len(self.gpus)
        if len(self.links) != num_gpus or any(len(row) != num_gpus for row in self.links):
            raise ValueError(f"the link matrix must be {num_gpus}x{num_gpus}, one row per GPU")
        for i, row in enumerate(self.links):
            for j, link in enumerate(row):
                if (link is None) != (i == j):
                    raise ValueError(f"links[{i}][{j}] must be {'None' if i == j else 'a class'}")
        for nic in self.nics:
            if len(nic.gpu_links) != num_gpus:
                raise ValueError(f"NIC {nic.name} has {len(nic.gpu_links)} GPU links, expected "
                                 f"{num_gpus}")

    def link(self, i: int, j: int) -> LinkClass:
        """The link between the GPUs at positions i != j."""
        link = self.links[i][j]
        assert link is not None, "a GPU has no link to itself"
        return link

    def position_of(self, index: int) -> int:
        for position, gpu in enumerate(self.gpus):
            if gpu.index == index:
                return position
        raise ValueError(f"no GPU with index {index}; the node has {self.gpu_indices()}")

    def gpu_indices(self) -> list[int]:
        return [gpu.index for gpu in self.gpus]


@dataclass(frozen=True)
class NodeTopology:
    """Everything grouping needs to know about one node; `sources` says which probes filled it."""

    name: NodeName
    gpu_topology: GpuTopology = field(default_factory=GpuTopology)
    ib_ports: tuple[IBPort, ...] = ()
    num_cpu_cores: Optional[int] = None
    num_numa_nodes: Optional[int] = None
    sources: tuple[str, ...] = ()
    socket_ifname: Optional[str] = None  # the interface that carries this node's address
    warnings: tuple[str, ...] = ()  # probe tools that failed partway, each naming the device

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return self.gpu_topology.gpus

    @property
    def links(self) -> Links:
        return self.gpu_topology.links

    @property
    def nics(self) -> tuple[Nic, ...]:
        return self.gpu_topology.nics

    def active_ib_ports(self) -> tuple[IBPort, ...]:
        """Active ports of InfiniBand link layer (ACTIVE and LinkUp)."""
        return tuple(port for port in self.ib_ports if port.is_infiniband and port.is_active)

    def fabric(self) -> tuple[str, tuple[IBPort, ...]]:
        """The RDMA fabric a group spanning nodes uses here and its active ports: InfiniBand
        ("IB") where the node has an active IB port, else RoCE (active ports of Ethernet link
        layer, which NCCL's IB transport drives too); ("", ()) with neither. A node with both
        keeps to IB: its RoCE port is then usually the front-end or storage network."""
        infiniband = self.active_ib_ports()
        if infiniband:
            return "IB", infiniband
        roce = tuple(port for port in self.ib_ports if port.is_active)
        return ("RoCE", roce) if roce else ("", ())

    def to_dict(self) -> dict:
        """The JSON shape of `tpserve topology parse/probe`."""
        return {
            "name": self.name,
            **gpu_topology_to_dict(self.gpu_topology),
            "ib_ports": [ib_port_to_dict(port) for port in self.ib_ports],
            "num_cpu_cores": self.num_cpu_cores,
            "num_numa_nodes": self.num_numa_nodes,
            "sources": list(self.sources),
            "socket_ifname": self.socket_ifname,
            "warnings": list(self.warnings),
        }


def gpu_topology_to_dict(topology: GpuTopology) -> dict:
    """`gpus`, `links` (class strings, "X" on the diagonal) and `nics` as plain JSON values."""
    return {
        "gpus": [
            {"index": gpu.index, "name": gpu.name, "memory_mib": gpu.memory_mib,
             "numa_node": gpu.numa_node, "pci_bus_id": gpu.pci_bus_id,
             "cpu_affinity": gpu.cpu_affinity, "is_healthy": gpu.is_healthy}
            for gpu in topology.gpus
        ],
        "links": [["X" if link is None else str(link) for link in row] for row in topology.links],
        "nics": [
            {"name": nic.name, "label": nic.label,
             "gpu_links": [str(link) for link in nic.gpu_links],
             "close_gpus": close_gpus(topology, nic)}
            for nic in topology.nics
        ],
    }


def ib_port_to_dict(port: IBPort) -> dict:
    return {"device": port.device, "port": port.port, "state": port.state,
            "phys_state": port.phys_state, "rate_gbps": port.rate_gbps,
            "link_layer": port.link_layer, "is_active": port.is_active}


def close_gpus(topology: GpuTopology, nic: Nic) -> list[int]:
    """Indices of the GPUs nearest the NIC; empty when the NIC is only reachable over NODE/SYS."""
    if not nic.gpu_links:
        return []
    best = max(nic.gpu_links)
    if best < LinkClass(LinkKind.PHB):
        return []
    pairs = zip(topology.gpus, nic.gpu_links, strict=True)
    return [gpu.index for gpu, link in pairs if link == best]
