"""Topology parsers on every real fixture, on variants derived from them, and the node probe."""

from __future__ import annotations

import os
import re
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel import topology_probe
from parallel.topology import LinkClass, LinkKind, close_gpus
from parallel.topology_parse import parse_ibstat, parse_nvidia_smi_topo, parse_sysfs_infiniband

DATA = Path(__file__).resolve().parents[1] / "data" / "topology"
FIXTURES = sorted(DATA.glob("*.txt"))
H100_TOPO = DATA / "nvidia-smi-topo_h100x8_nv18_12nic.txt"
PCIE_TOPO = DATA / "nvidia-smi-topo_pcie2_phb.txt"
A100_IBSTAT = DATA / "ibstat_a100_all_active.txt"
H100_IBSTAT = DATA / "ibstat_h100_all_active.txt"


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _without_source(text: str) -> str:
    return text.split("\n", 1)[1]


def _without_legends(text: str) -> str:
    return text.split("Legend:")[0]


def _spaces_for_tabs(text: str) -> str:
    """Align columns with spaces, as a terminal copy-paste does (empty cells vanish)."""
    return "\n".join("  ".join(cell.strip().ljust(6) for cell in line.split("\t")).rstrip()
                     for line in text.splitlines())


def _indented(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _summary(topology) -> tuple:
    return (topology.gpus, topology.links, topology.nics)


# --------------------------------------------------------------------------- real fixtures


def test_every_fixture_parses():
    # An empty glob would make this pass on nothing: the four fixtures live in the repository.
    assert [p.name for p in FIXTURES] == sorted(
        p.name for p in (H100_TOPO, PCIE_TOPO, A100_IBSTAT, H100_IBSTAT))
    for path in FIXTURES:
        text = _read(path)
        assert text.startswith("# SOURCE: "), f"{path.name} lost its provenance line"
        if path.name.startswith("nvidia-smi-topo"):
            assert parse_nvidia_smi_topo(text).gpus, path.name
        elif path.name.startswith("ibstat"):
            assert parse_ibstat(text), path.name
        else:
            pytest.fail(f"no parser test for fixture {path.name}")


def test_h100_nv18_with_twelve_nics():
    topology = parse_nvidia_smi_topo(_read(H100_TOPO))
    assert [gpu.index for gpu in topology.gpus] == list(range(8))
    assert all(gpu.numa_node == 0 and gpu.cpu_affinity == "0-191" for gpu in topology.gpus)
    assert {str(link) for row in topology.links for link in row if link} == {"NV18"}
    assert all(topology.links[i][i] is None for i in range(8))
    assert [nic.name for nic in topology.nics] == [f"mlx5_{k}" for k in range(12)]
    assert [nic.label for nic in topology.nics] == [f"NIC{k}" for k in range(12)]
    # NIC0..2 sit on GPU0..2, NIC3/NIC4 share a switch with no GPU, NIC5..8 on GPU3..6, NIC11 GPU7
    close = [close_gpus(topology, nic) for nic in topology.nics]
    assert close == [[0], [1], [2], [], [], [3], [4], [5], [6], [], [], [7]]


def test_pcie_pair_over_host_bridge():
    topology = parse_nvidia_smi_topo(_read(PCIE_TOPO))
    assert [(gpu.index, gpu.numa_node, gpu.cpu_affinity) for gpu in topology.gpus] == [
        (0, 0, "0-63"), (1, 0, "0-63")]
    assert topology.link(0, 1) == LinkClass(LinkKind.PHB)
    assert topology.nics == ()


def test_ibstat_a100_all_active():
    ports = parse_ibstat(_read(A100_IBSTAT))
    assert [port.device for port in ports] == [f"mlx5_{k}" for k in range(9)]
    assert all(port.is_active and port.rate_gbps == 200 and port.port == 1 for port in ports)
    assert ports[0].link_layer == "Ethernet" and not ports[0].is_infiniband
    assert all(port.is_infiniband for port in ports[1:])


def test_ibstat_h100_400g_and_an_ethernet_bond():
    ports = parse_ibstat(_read(H100_IBSTAT))
    infiniband = [port for port in ports if port.is_infiniband]
    assert len(infiniband) == 8 and {port.rate_gbps for port in infiniband} == {400.0}
    (bond,) = [port for port in ports if not port.is_infiniband]
    assert bond.device == "mlx5_bond_0" and bond.rate_gbps == 200


# --------------------------------------------------------------------------- nvidia-smi variants


@pytest.mark.parametrize("fixture", [H100_TOPO, PCIE_TOPO], ids=lambda p: p.name)
@pytest.mark.parametrize("variant", [_without_source, _spaces_for_tabs, _indented,
                                     lambda t: _indented(_spaces_for_tabs(t), "\t"),
                                     lambda t: t.replace("\n", "\r\n")],
                         ids=["no-source", "spaces", "indented", "spaces-tab-indented", "crlf"])
def test_nvidia_smi_layout_variants_parse_the_same(fixture, variant):
    text = _read(fixture)
    assert _summary(parse_nvidia_smi_topo(variant(text))) == _summary(parse_nvidia_smi_topo(text))


def test_without_legend_nics_keep_their_column_labels():
    topology = parse_nvidia_smi_topo(_without_legends(_read(H100_TOPO)))
    assert [nic.name for nic in topology.nics] == [f"NIC{k}" for k in range(12)]
    assert topology.links == parse_nvidia_smi_topo(_read(H100_TOPO)).links


def test_nic_columns_named_by_device():
    text = _without_legends(_read(H100_TOPO))
    text = re.sub(r"\bNIC(\d+)\b", r"mlx5_\1", text)
    topology = parse_nvidia_smi_topo(text)
    assert [nic.name for nic in topology.nics] == [f"mlx5_{k}" for k in range(12)]
    assert close_gpus(topology, topology.nics[5]) == [3]


def test_without_affinity_columns():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n"
    topology = parse_nvidia_smi_topo(text)
    assert str(topology.link(0, 1)) == "NV4"
    assert topology.gpus[0].numa_node is None and topology.gpus[0].cpu_affinity is None


def test_old_driver_names_and_unknown_numa():
    text = ("        GPU0    GPU1    CPU Affinity    NUMA Affinity\n"
            "GPU0     X      SOC     0-11            N/A\n"
            "GPU1    SOC      X      12-23           N/A\n")
    topology = parse_nvidia_smi_topo(text)
    assert topology.link(0, 1) == LinkClass(LinkKind.SYS)
    assert [gpu.numa_node for gpu in topology.gpus] == [None, None]
    assert topology.gpus[1].cpu_affinity == "12-23"


def test_trailing_tool_error_and_leading_warning_are_skipped(caplog):
    text = ("WARNING: infoROM is corrupted at gpu 0000:3B:00.0\n" + _read(PCIE_TOPO)
            + "\nFailed to initialize NVML: Driver/library version mismatch\n")
    topology = parse_nvidia_smi_topo(text)
    assert len(topology.gpus) == 2
    assert "version mismatch" in caplog.text and "infoROM" in caplog.text


@pytest.mark.parametrize("text, line, words", [
    ("# SOURCE: x\nFailed to initialize NVML: Driver/library version mismatch\n", 2,
     "header row"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tFOO\t X \n", 3, "unknown link class 'FOO'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\n", 3, "2 link cells"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU7\tNV4\t X \n", 3, "a row of one of"),
    ("\tGPU0\tGPU1\nGPU0\tNV4\tNV4\nGPU1\tNV4\t X \n", 2, "'X' exactly in column GPU0"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nLegend:\n", 3, "a row of one of"),
])
def test_unreadable_topo_names_the_line(text, line, words):
    with pytest.raises(ValueError, match=rf"line {line}: cannot read .*{re.escape(words)}"):
        parse_nvidia_smi_topo(text)


def test_truncated_and_asymmetric_matrices_are_errors():
    with pytest.raises(ValueError, match=r"ends before the rows of \['GPU1'\]"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tNV4\n")
    with pytest.raises(ValueError, match="symmetric"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tPIX\t X \n")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["", " ", "  ", "\t", " \t "]), min_size=60, max_size=60),
       st.sampled_from(["\t", "  ", " \t", "\t\t"]))
def test_any_whitespace_layout_parses_the_same(indents, separator):
    text = _read(H100_TOPO)
    lines = [line.replace("\t", separator) for line in text.splitlines()]
    varied = "\n".join(indent + line for indent, line in zip(indents, lines, strict=False))
    assert _summary(parse_nvidia_smi_topo(varied)) == _summary(parse_nvidia_smi_topo(text))


# --------------------------------------------------------------------------- ibstat variants


def _port_down(text: str) -> str:
    text = text.replace("State: Active", "State: Down", 1)
    return text.replace("Physical state: LinkUp", "Physical state: Disabled", 1)


@pytest.mark.parametrize("variant", [
    _without_source, lambda t: t.replace("\t", "    "),
    lambda t: "\n".join(line.strip() for line in t.splitlines()),
    lambda t: _indented(t, "  "),
    lambda t: t + "\nSegmentation fault (core dumped)\n",
], ids=["no-source", "spaces", "no-indent", "indented", "trailing-error"])
@pytest.mark.parametrize("fixture", [A100_IBSTAT, H100_IBSTAT], ids=lambda p: p.name)
def test_ibstat_layout_variants_parse_the_same(fixture, variant):
    text = _read(fixture)
    assert parse_ibstat(variant(text)) == parse_ibstat(text)


def test_ibstat_port_down():
    ports = parse_ibstat(_port_down(_read(H100_IBSTAT)))
    assert (ports[0].state, ports[0].phys_state, ports[0].is_active) == ("DOWN", "Disabled", False)
    assert all(port.is_active for port in ports[1:])


def test_ibstat_two_ports_one_polling():
    text = ("CA 'mlx4_0'\n\tCA type: MT4099\n\tNumber of ports: 2\n"
            "\tPort 1:\n\t\tState: Active\n\t\tPhysical state: LinkUp\n\t\tRate: 56\n"
            "\t\tLink layer: InfiniBand\n"
            "\tPort 2:\n\t\tState: Down\n\t\tPhysical state: Polling\n\t\tRate: 10\n"
            "\t\tLink layer: InfiniBand\n")
    ports = parse_ibstat(text)
    assert [(p.port, p.is_active, p.rate_gbps) for p in ports] == [(1, True, 56.0),
                                                                   (2, False, 10.0)]


def test_ibstat_empty_output_means_no_ports():
    assert parse_ibstat("") == [] and parse_ibstat("# SOURCE: none\n\n") == []


@pytest.mark.parametrize("text, words", [
    ("ibpanic without a colon, no CA at all\n", "line 1: cannot read"),
    ("CA 'mlx5_0'\n Port 1:\n  State: Active\n  Physical state: LinkUp\n  Rate: 400\n"
     "garbage in the middle\nCA 'mlx5_1'\n", "line 6: cannot read 'garbage in the middle'"),
    ("CA 'mlx5_0'\n Port 1:\n  State: Active\n  Physical state: LinkUp\n",
     r"line 2: port 1 of mlx5_0 lacks \['rate'\]"),
    ("CA 'mlx5_0'\n Port 1:\n  State: Active\n  Physical state: LinkUp\n  Rate: fast\n",
     "cannot read rate 'fast'"),
    ("  Port 1:\n  State: Active\n", "line 1: cannot read 'Port 1:': expected a CA"),
])
def test_unreadable_ibstat_names_the_line(text, words):
    with pytest.raises(ValueError, match=words):
        parse_ibstat(text)


# --------------------------------------------------------------------------- sysfs


def _write_sysfs(root: Path, ports) -> None:
    codes = {"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN"}
    phys = {"LinkUp": "5: LinkUp", "Disabled": "3: Disabled"}
    for port in ports:
        port_dir = root / port.device / "ports" / str(port.port)
        port_dir.mkdir(parents=True)
        (port_dir / "state").write_text(codes[port.state] + "\n")
        (port_dir / "phys_state").write_text(phys[port.phys_state] + "\n")
        (port_dir / "rate").write_text(f"{port.rate_gbps:g} Gb/sec (4X NDR)\n")
        (port_dir / "link_layer").write_text(port.link_layer + "\n")


def test_sysfs_tree_reads_like_ibstat(tmp_path):
    ports = parse_ibstat(_port_down(_read(H100_IBSTAT)))
    _write_sysfs(tmp_path, ports)
    by_device = sorted(ports, key=lambda p: [int(x) if x.isdigit() else x
                                             for x in re.split(r"(\d+)", p.device)])
    assert parse_sysfs_infiniband(str(tmp_path)) == by_device


def test_sysfs_missing_root_and_missing_rate(tmp_path):
    assert parse_sysfs_infiniband(str(tmp_path / "absent")) == []
    _write_sysfs(tmp_path, parse_ibstat(_read(A100_IBSTAT))[:1])
    (tmp_path / "mlx5_0" / "ports" / "1" / "rate").unlink()
    with pytest.raises(ValueError, match=r"mlx5_0/ports/1: port 1 of mlx5_0 lacks \['rate'\]"):
        parse_sysfs_infiniband(str(tmp_path))


# --------------------------------------------------------------------------- link classes


def test_link_class_order_and_names():
    names = ["NV18", "NV12", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    classes = [LinkClass.parse(name) for name in names]
    assert classes == sorted(classes, reverse=True)
    assert [str(link) for link in classes] == names
    assert LinkClass.parse("SOC") == LinkClass.parse("SYS")
    for bad in ("NV", "NV0", "X", "LINK"):
        with pytest.raises(ValueError):
            LinkClass.parse(bad)


# --------------------------------------------------------------------------- probe


@pytest.fixture
def bare_node(monkeypatch, tmp_path):
    """No fixtures, no tools on PATH, no pynvml, no /sys/class/infiniband."""
    for variable in (topology_probe.NVSMI_FILE_ENV, topology_probe.IBSTAT_FILE_ENV):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(topology_probe, "SYSFS_INFINIBAND", str(tmp_path / "no-ib"))
    return monkeypatch


def test_probe_of_a_cpu_only_node(bare_node):
    node = topology_probe.probe_node("cpu-box")
    assert node.name == "cpu-box" and node.gpus == () and node.ib_ports == ()
    assert node.num_cpu_cores >= 1 and node.sources == ()


def test_probe_reads_fixture_files_named_by_env(bare_node):
    bare_node.setenv(topology_probe.NVSMI_FILE_ENV, str(H100_TOPO))
    bare_node.setenv(topology_probe.IBSTAT_FILE_ENV, str(H100_IBSTAT))
    node = topology_probe.probe_node("h100")
    assert len(node.gpus) == 8 and len(node.active_ib_ports()) == 8
    assert node.sources == (f"file:{H100_TOPO}", f"file:{H100_IBSTAT}")


def test_probe_with_missing_fixture_file_says_which(bare_node, tmp_path):
    bare_node.setenv(topology_probe.NVSMI_FILE_ENV, str(tmp_path / "nope.txt"))
    with pytest.raises(OSError, match="TPSERVE_TOPOLOGY_NVSMI_FILE=.*nope.txt"):
        topology_probe.probe_node()


def test_probe_reads_sysfs_infiniband(bare_node, tmp_path):
    _write_sysfs(tmp_path / "ib", parse_ibstat(_read(A100_IBSTAT)))
    bare_node.setattr(topology_probe, "SYSFS_INFINIBAND", str(tmp_path / "ib"))
    node = topology_probe.probe_node()
    assert len(node.ib_ports) == 9 and node.sources == ("sysfs",)


def test_numa_nodes_counted_from_sysfs(tmp_path):
    for name in ("node0", "node1", "possible", "online"):
        (tmp_path / name).mkdir()
    assert topology_probe.count_numa_nodes(str(tmp_path)) == 2
    assert topology_probe.count_numa_nodes(str(tmp_path / "absent")) is None


def _fake_pynvml(nvlinks: dict[int, list], p2p_ok: bool) -> types.ModuleType:
    """An NVML stand-in: `nvlinks[gpu]` lists each link's remote ("switch" or a GPU index)."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    bus = [f"00000000:{0x18 + 0x10 * k:02X}:00.0" for k in range(len(nvlinks))]
    nvml.NVMLError = NVMLError
    nvml.NVML_NVLINK_MAX_LINKS, nvml.NVML_FEATURE_ENABLED = 18, 1
    nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, nvml.NVML_P2P_CAPS_INDEX_NVLINK = 2, 2
    nvml.NVML_P2P_STATUS_OK = 0
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: len(nvlinks)
    nvml.nvmlDeviceGetHandleByIndex = lambda k: k
    nvml.nvmlDeviceGetName = lambda k: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetMemoryInfo = lambda k: types.SimpleNamespace(total=80 << 30)
    nvml.nvmlDeviceGetPciInfo = lambda k: types.SimpleNamespace(busId=bus[k])

    def link_remote(k, link):
        if link >= len(nvlinks[k]):
            raise NVMLError("not supported")
        return nvlinks[k][link]

    nvml.nvmlDeviceGetNvLinkState = lambda k, link: link_remote(k, link) and 1
    nvml.nvmlDeviceGetNvLinkRemoteDeviceType = (
        lambda k, link: 2 if link_remote(k, link) == "switch" else 0)
    nvml.nvmlDeviceGetNvLinkRemotePciInfo = (
        lambda k, link: types.SimpleNamespace(busId=bus[link_remote(k, link)]))
    nvml.nvmlDeviceGetP2PStatus = lambda a, b, caps: 0 if p2p_ok else 1
    nvml.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 10 if {a, b} == {0, 1} else 50
    return nvml


def test_nvml_probe_maps_switched_direct_and_pcie_links(bare_node):
    bare_node.setitem(sys.modules, "pynvml", _fake_pynvml({0: ["switch"] * 18, 1: ["switch"] * 18},
                                                          p2p_ok=True))
    topology = topology_probe.probe_nvml()
    assert str(topology.link(0, 1)) == "NV18"
    assert topology.gpus[1].name == "NVIDIA H100 80GB HBM3"
    assert topology.gpus[1].memory_mib == 80 << 10
    assert topology.gpus[1].pci_bus_id.endswith("28:00.0")
    bare_node.setitem(sys.modules, "pynvml", _fake_pynvml({0: [1, 1, 2], 1: [0, 0], 2: [0]},
                                                          p2p_ok=False))
    topology = topology_probe.probe_nvml()
    assert [str(topology.link(0, k)) for k in (1, 2)] == ["NV2", "NV1"]
    assert str(topology.link(1, 2)) == "SYS"
    bare_node.setitem(sys.modules, "pynvml", _fake_pynvml({0: [], 1: []}, p2p_ok=False))
    assert str(topology_probe.probe_nvml().link(0, 1)) == "PIX"


@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs a real NVIDIA GPU")
def test_real_probe_on_a_gpu_node():
    node = topology_probe.probe_node()
    assert node.gpus and all(gpu.name for gpu in node.gpus)
