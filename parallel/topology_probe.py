"""Probe THIS node's topology: GPUs and their links, NICs, InfiniBand ports, CPU cores, NUMA nodes.

GPU sources, first that works: the file named by `TPSERVE_TOPOLOGY_NVSMI_FILE` (a saved
`nvidia-smi topo -m`, for tests and for nodes whose tools cannot run), NVML through `pynvml`
(`nvidia-ml-py`), then `nvidia-smi topo -m`. IB sources: `TPSERVE_TOPOLOGY_IBSTAT_FILE`, then
/sys/class/infiniband, then `ibstat`. A node without GPUs or HCAs reports none, with a log line
saying why; a probe never raises because a tool is missing. A fixture file that cannot be read or
parsed does raise: it was asked for explicitly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import socket
import subprocess
from typing import Callable, Optional

from parallel.topology import (
    Gpu,
    GpuIndex,
    GpuTopology,
    IBPort,
    LinkClass,
    LinkKind,
    NodeName,
    NodeTopology,
)
from parallel.topology_parse import parse_nvidia_smi_topo, parse_sysfs_infiniband, read_ibstat

logger = logging.getLogger(__name__)

NVSMI_FILE_ENV = "TPSERVE_TOPOLOGY_NVSMI_FILE"
IBSTAT_FILE_ENV = "TPSERVE_TOPOLOGY_IBSTAT_FILE"
SYSFS_INFINIBAND = "/sys/class/infiniband"
SYSFS_NUMA_NODES = "/sys/devices/system/node"
_TOOL_TIMEOUT_S = 30.0


def probe_node(name: Optional[str] = None, address: Optional[str] = None) -> NodeTopology:
    """This node's topology, named `name` (default: the host name); `address` (the node's
    cluster address) names the socket interface ranks on this node talk over."""
    gpu_topology, gpu_source = probe_gpus()
    ib_ports, ib_source, ib_warnings = probe_ib_ports()
    return NodeTopology(
        name=NodeName(name or socket.gethostname()),
        gpu_topology=gpu_topology,
        ib_ports=tuple(ib_ports),
        num_cpu_cores=count_cpu_cores(),
        num_numa_nodes=count_numa_nodes(),
        sources=tuple(source for source in (gpu_source, ib_source) if source),
        socket_ifname=interface_of(address) if address else None,
        warnings=gpu_topology.warnings + tuple(ib_warnings),
    )


def probe_gpus() -> tuple[GpuTopology, Optional[str]]:
    """The GPU topology and the name of its source, or an empty topology and None."""
    fixture = os.environ.get(NVSMI_FILE_ENV)
    if fixture:
        return parse_nvidia_smi_topo(_read_file(fixture, NVSMI_FILE_ENV)), f"file:{fixture}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the raylet's, which the probe inherits
    topology = probe_nvml()
    if topology is not None:
        return restrict_to_visible(_with_nvidia_smi_nics(topology), visible), "nvml"
    run = _run_tool(["nvidia-smi", "topo", "-m"])
    if run is not None:
        text, failed = run
        try:
            topology = parse_nvidia_smi_topo(text)
            topology = dataclasses.replace(topology, warnings=topology.warnings + failed)
            return restrict_to_visible(topology, visible), "nvidia-smi"
        except ValueError as exc:
            logger.warning("nvidia-smi topo -m printed what cannot be read, no GPUs used: %s", exc)
    return GpuTopology(), None


def restrict_to_visible(topology: GpuTopology, visible: Optional[str]) -> GpuTopology:
    """``topology`` without the GPUs outside ``visible`` (``CUDA_VISIBLE_DEVICES`` as the node's
    raylet was started with: its GPUs are those, other GPUs of the host may be another node's
    or another tenant's), each with a warning. NVML and nvidia-smi see every GPU of the host.
    Unset or empty (Ray's zero-GPU override) restricts nothing; UUIDs or MIG ids, which the
    probe cannot match, restrict nothing and say so."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if not entries:
        return topology
    if not all(e.isdigit() for e in entries):
        return dataclasses.replace(topology, warnings=topology.warnings + (
            f"CUDA_VISIBLE_DEVICES={visible} names GPUs by UUID or MIG id, which the probe "
            f"cannot match: every GPU it found is planned",))
    allowed = {int(e) for e in entries}
    keep = [i for i, gpu in enumerate(topology.gpus) if gpu.index in allowed]
    if len(keep) == len(topology.gpus):
        return topology
    dropped = [int(gpu.index) for gpu in topology.gpus if gpu.index not in allowed]
    return GpuTopology(
        gpus=tuple(topology.gpus[i] for i in keep),
        links=tuple(tuple(topology.links[i][j] for j in keep) for i in keep),
        nics=tuple(dataclasses.replace(nic, gpu_links=tuple(nic.gpu_links[i] for i in keep))
                   for nic in topology.nics),
        warnings=topology.warnings + (
            f"GPU(s) {dropped} are outside this node's CUDA_VISIBLE_DEVICES={visible}: not "
            f"planned",))


def _with_nvidia_smi_nics(topology: GpuTopology) -> GpuTopology:
    """NVML knows no NICs: take their GPU affinity from `nvidia-smi topo -m` when it runs."""
    run = _run_tool(["nvidia-smi", "topo", "-m"])
    if run is None:
        return topology
    try:
        nics = parse_nvidia_smi_topo(run[0]).nics
    except ValueError as exc:
        logger.warning("NIC affinity unknown, nvidia-smi topo -m unreadable: %s", exc)
        return topology
    if any(len(nic.gpu_links) != len(topology.gpus) for nic in nics):
        logger.warning("NIC affinity unknown: nvidia-smi and NVML disagree on the GPU count")
        return topology
    return dataclasses.replace(topology, nics=nics)


def probe_ib_ports() -> tuple[list[IBPort], Optional[str], tuple[str, ...]]:
    """The InfiniBand ports, the name of their source (or [] and None), and warnings about
    devices the source could not read."""
    fixture = os.environ.get(IBSTAT_FILE_ENV)
    if fixture:
        report = read_ibstat(_read_file(fixture, IBSTAT_FILE_ENV))
        return list(report.ports), f"file:{fixture}", report.warnings
    if os.path.isdir(SYSFS_INFINIBAND):
        try:
            return parse_sysfs_infiniband(SYSFS_INFINIBAND), "sysfs", ()
        except (OSError, ValueError) as exc:
            logger.warning("cannot read %s, trying ibstat: %s", SYSFS_INFINIBAND, exc)
    run = _run_tool(["ibstat"])
    if run is not None:
        text, failed = run
        try:
            report = read_ibstat(text)
            return list(report.ports), "ibstat", report.warnings + failed
        except ValueError as exc:
            logger.warning("ibstat printed what cannot be read, no IB ports used: %s", exc)
    return [], None, ()


def count_cpu_cores() -> Optional[int]:
    """CPUs this process may run on (the cgroup/affinity view, not the host's total)."""
    sched_getaffinity: Optional[Callable] = getattr(os, "sched_getaffinity", None)
    if sched_getaffinity is not None:
        return len(sched_getaffinity(0))
    return os.cpu_count()


def count_numa_nodes(root_dir: str = SYSFS_NUMA_NODES) -> Optional[int]:
    """NUMA nodes under /sys/devices/system/node (`node0`, `node1`, ...); None where absent."""
    try:
        names = os.listdir(root_dir)
    except OSError:
        return None
    return sum(1 for name in names if re.fullmatch(r"node\d+", name)) or None


def _read_file(path: str, variable: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise OSError(f"{variable}={path}: cannot read the topology file: {exc}") from exc


def _run_tool(argv: list[str]) -> Optional[tuple[str, tuple[str, ...]]]:
    """The tool's output (stdout, then stderr) and a warning when it exited non-zero; None
    (logged) when it is missing, hangs, or fails without printing anything on stdout. A tool
    that fails partway keeps what it printed: its error line names the device it stopped at."""
    if shutil.which(argv[0]) is None:
        logger.info("%s not on PATH", argv[0])
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("%s failed: %s", " ".join(argv), exc)
        return None
    command = " ".join(argv)
    if done.returncode != 0 and not done.stdout.strip():
        logger.warning("%s exited %d: %s", command, done.returncode,
                       (done.stderr or done.stdout).strip()[:500])
        return None
    failed: tuple[str, ...] = ()
    if done.returncode != 0:
        failed = (f"{command} exited {done.returncode} after printing part of its output: "
                  f"{done.stderr.strip()[:300]!r}",)
        logger.warning("%s", failed[0])
    return done.stdout + ("\n" + done.stderr if done.stderr.strip() else ""), failed


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface that holds `address` (`ip -o addr`), or None."""
    run = _run_tool(["ip", "-o", "-4", "addr", "show"])
    if run is None:
        return None
    for line in run[0].splitlines():  # "2: eth0    inet 10.0.0.5/24 brd ... scope global eth0"
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "inet" and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    return None


# ---------------------------------------------------------------------------------------------
# NVML (nvidia-ml-py)

# nvmlDeviceGetTopologyCommonAncestor levels -> the classes `nvidia-smi topo -m` prints.
_NVML_ANCESTOR_KIND = {0: LinkKind.PIX, 10: LinkKind.PIX, 20: LinkKind.PXB, 30: LinkKind.PHB,
                       40: LinkKind.NODE, 50: LinkKind.SYS}


def probe_nvml() -> Optional[GpuTopology]:
    """GPUs and their links from NVML; None when pynvml is missing, NVML fails or finds no GPU."""
    try:
        import pynvml
    except ImportError:
        logger.info("pynvml (nvidia-ml-py) not installed: NVML probe skipped")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.info("NVML unavailable: %s", exc)
        return None
    try:
        return _nvml_topology(pynvml)
    except pynvml.NVMLError as exc:
        logger.warning("NVML probe failed, trying nvidia-smi: %s", exc)
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_topology(nvml) -> Optional[GpuTopology]:
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        return None
    handles, gpus = [], []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(_nvml_gpu(nvml, index, handle))
        except nvml.NVMLError as exc:  # a lost GPU: listed, never grouped
            logger.warning("GPU %d does not answer NVML, marked unhealthy: %s", index, exc)
            handle = None
            gpus.append(Gpu(index=GpuIndex(index), is_healthy=False))
        handles.append(handle)
    nvlinks = [_nvlink_counts(nvml, handle) for handle in handles]
    links = tuple(
        tuple(None if i == j else _nvml_link(nvml, handles, gpus, nvlinks, i, j)
              for j in range(count))
        for i in range(count))
    return GpuTopology(gpus=tuple(gpus), links=links)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_gpu(nvml, index: int, handle) -> Gpu:
    bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    return Gpu(
        index=GpuIndex(index),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
        numa_node=_pci_numa_node(bus_id),
        pci_bus_id=bus_id,
    )


def _pci_numa_node(bus_id: str) -> Optional[int]:
    """The NUMA node sysfs gives the PCI device (NVML's 8-digit domain cut to sysfs's 4)."""
    address = bus_id.lower()[-12:]
    try:
        with open(f"/sys/bus/pci/devices/{address}/numa_node", encoding="utf-8") as handle:
            node = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _nvlink_counts(nvml, handle) -> dict[str, int]:
    """Active NVLinks of one GPU by remote PCI bus id; NVSwitch links counted under "switch"."""
    counts: dict[str, int] = {}
    if handle is None:
        return counts
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            remote_type = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            if remote_type == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                key = "switch"
            else:
                key = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
        except nvml.NVMLError:  # link not present / not supported: the GPU has fewer links
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def _nvml_link(nvml, handles: list, gpus: list[Gpu], nvlinks: list[dict[str, int]], i: int,
               j: int) -> LinkClass:
    """NV<n> over direct links or a shared NVSwitch (P2P over NVLink OK), else the PCIe path."""
    if handles[i] is None or handles[j] is None:
        return LinkClass(LinkKind.SYS)
    direct = nvlinks[i].get((gpus[j].pci_bus_id or "").lower(), 0)
    if direct:
        return LinkClass(LinkKind.NV, direct)
    switched = min(nvlinks[i].get("switch", 0), nvlinks[j].get("switch", 0))
    try:
        if switched and nvml.nvmlDeviceGetP2PStatus(
                handles[i], handles[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK:
            return LinkClass(LinkKind.NV, switched)
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
    except nvml.NVMLError as exc:
        logger.warning("NVML cannot tell the link GPU%d-GPU%d, assuming SYS: %s", i, j, exc)
        return LinkClass(LinkKind.SYS)
    return LinkClass(_NVML_ANCESTOR_KIND.get(int(level), LinkKind.SYS))
