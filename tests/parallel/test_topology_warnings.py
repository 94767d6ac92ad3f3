"""Probe tools that fail partway are never silent: the ports or GPUs printed before the error are
kept, and a warning naming the device travels into the node's topology and the plan's explanation.

Each case is a truncated copy of a real output (tests/data/topology) with the error line the real
tool prints appended: `ibstat` ends in `ibpanic: [pid] main: stat of IB device '<ca>' failed: ...`
(its IBPANIC macro), `nvidia-smi` in `Unable to determine the device handle for GPU<bus id>: ...`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parallel import topology_probe
from parallel.grouping import plan_groups
from parallel.topology import NodeName, NodeTopology
from parallel.topology_parse import parse_ibstat, parse_nvidia_smi_topo, read_ibstat

DATA = Path(__file__).resolve().parents[1] / "data" / "topology"
A100_IBSTAT = DATA / "ibstat_a100_all_active.txt"
PCIE_TOPO = DATA / "nvidia-smi-topo_pcie2_phb.txt"
H100_TOPO = DATA / "nvidia-smi-topo_h100x8_nv18_12nic.txt"
IBPANIC = "ibpanic: [2137592] main: stat of IB device 'mlx5_5' failed: No such file or directory"
NVSMI_LOST = "Unable to determine the device handle for GPU0000:CB:00.0: Unknown Error"


def _ibstat_cut_before(ca: str) -> str:
    text = A100_IBSTAT.read_text(encoding="utf-8")
    return text[:text.index(f"CA '{ca}'")]


def _topo_without_legend(path: Path) -> str:
    return path.read_text(encoding="utf-8").split("Legend:")[0]


def test_ibstat_ending_in_ibpanic_keeps_the_ports_and_names_the_device():
    report = read_ibstat(_ibstat_cut_before("mlx5_5") + IBPANIC + "\n")
    assert [port.device for port in report.ports] == [f"mlx5_{k}" for k in range(5)]
    assert list(report.ports) == parse_ibstat(_ibstat_cut_before("mlx5_5"))
    (warning,) = report.warnings
    assert "mlx5_5" in warning and "ibpanic" in warning


def test_ibstat_warning_line_between_cas_is_reported_not_swallowed():
    text = _ibstat_cut_before("mlx5_3") + (
        "ibwarn: [4260] umad_get_port: can't open UMAD port (mlx5_3:1)\n")
    text += "CA 'mlx5_3'" + A100_IBSTAT.read_text(encoding="utf-8").split("CA 'mlx5_3'")[1]
    report = read_ibstat(text)
    assert len(report.ports) == 9
    (warning,) = report.warnings
    assert "mlx5_3" in warning and "ibwarn" in warning


def test_whole_ibstat_output_has_no_warning():
    assert read_ibstat(A100_IBSTAT.read_text(encoding="utf-8")).warnings == ()


@pytest.mark.parametrize("fixture", [PCIE_TOPO, H100_TOPO], ids=lambda p: p.name)
def test_nvidia_smi_ending_in_a_device_error_keeps_the_gpus_and_names_the_device(fixture):
    clean = parse_nvidia_smi_topo(_topo_without_legend(fixture))
    topology = parse_nvidia_smi_topo(_topo_without_legend(fixture) + NVSMI_LOST + "\n")
    assert topology.gpus == clean.gpus and topology.links == clean.links
    (warning,) = topology.warnings
    assert "0000:CB:00.0" in warning and "Unknown Error" in warning
    assert clean.warnings == ()


def test_nvidia_smi_error_before_the_matrix_is_a_warning_too():
    text = "Unable to determine the device handle for GPU2: 0000:34:00.0: Unknown Error\n"
    without_source = PCIE_TOPO.read_text(encoding="utf-8").split("\n", 1)[1]
    topology = parse_nvidia_smi_topo(text + without_source)
    assert len(topology.gpus) == 2
    (warning,) = topology.warnings
    assert "GPU2" in warning and "0000:34:00.0" in warning


def test_warnings_reach_the_plan_explanation(tmp_path):
    gpus = parse_nvidia_smi_topo(_topo_without_legend(PCIE_TOPO) + NVSMI_LOST + "\n")
    node = NodeTopology(NodeName("box"), gpus, warnings=gpus.warnings)
    plan = plan_groups([node], 2)
    assert len(plan.groups) == 1
    assert any(line.startswith("warning: box: ") and "0000:CB:00.0" in line
               for line in plan.explanation())
    assert plan.to_dict()["warnings"] == [f"box: {gpus.warnings[0]}"]


@pytest.fixture
def bare_node(monkeypatch, tmp_path):
    for variable in (topology_probe.NVSMI_FILE_ENV, topology_probe.IBSTAT_FILE_ENV):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(topology_probe, "SYSFS_INFINIBAND", str(tmp_path / "no-ib"))
    return monkeypatch


def _fake_tool(tmp_path: Path, name: str, stdout: str, stderr: str, code: int) -> None:
    (tmp_path / f"{name}.out").write_text(stdout)
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\n/bin/cat '{tmp_path / f'{name}.out'}'\n"
                      f"echo \"{stderr}\" >&2\nexit {code}\n")
    script.chmod(0o755)


def test_probe_keeps_what_a_failing_ibstat_printed(bare_node, tmp_path):
    """Real ibstat exits non-zero after IBPANIC: the ports it printed still count, with a
    warning that names the device and the exit status."""
    _fake_tool(tmp_path, "ibstat", _ibstat_cut_before("mlx5_5"), IBPANIC, 255)
    ports, source, warnings = topology_probe.probe_ib_ports()
    assert source == "ibstat" and len(ports) == 5 and len(warnings) == 2
    node = topology_probe.probe_node("box")
    assert len(node.ib_ports) == 5
    assert any("mlx5_5" in warning for warning in node.warnings)
    assert any("exited 255" in warning for warning in node.warnings)


def test_probe_fixture_file_with_a_tool_error_warns(bare_node, tmp_path):
    truncated = tmp_path / "ibstat.txt"
    truncated.write_text(_ibstat_cut_before("mlx5_5") + IBPANIC + "\n")
    bare_node.setenv(topology_probe.IBSTAT_FILE_ENV, str(truncated))
    node = topology_probe.probe_node("box")
    assert len(node.ib_ports) == 5 and len(node.warnings) == 1
    assert "mlx5_5" in node.warnings[0] and node.to_dict()["warnings"] == list(node.warnings)


def test_fake_tool_runs(tmp_path):  # the helper itself: a real process, exit status kept
    _fake_tool(tmp_path, "tool", "out\n", "err", 3)
    assert os.system(f"{tmp_path / 'tool'} >/dev/null 2>&1") >> 8 == 3


def test_interface_of_an_address_is_read_from_ip():
    """The probe names the interface that holds the node's address (`ip -o -4 addr`)."""
    if not os.path.exists("/usr/sbin/ip") and not os.path.exists("/sbin/ip"):
        pytest.skip("no `ip` command")
    assert topology_probe.interface_of("127.0.0.1") == "lo"
    assert topology_probe.interface_of("203.0.113.254") is None  # held by no interface here
