"""`tpserve topology probe|parse|plan`, run as a user runs it: a subprocess of `-m cluster.cli.main`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "topology"
H100_TOPO = DATA / "nvidia-smi-topo_h100x8_nv18_12nic.txt"
PCIE_TOPO = DATA / "nvidia-smi-topo_pcie2_phb.txt"
A100_IBSTAT = DATA / "ibstat_a100_all_active.txt"
H100_IBSTAT = DATA / "ibstat_h100_all_active.txt"


def tpserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", "topology", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def tpserve_json(*args: str, env: dict | None = None) -> dict:
    done = tpserve(*args, "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_parse_h100_json_shape():
    data = tpserve_json("parse", "--nvidia-smi", H100_TOPO, "--ibstat", H100_IBSTAT)
    assert set(data) == {"gpus", "links", "nics", "ib_ports", "warnings"}
    assert data["warnings"] == []
    assert [(gpu["index"], gpu["numa_node"]) for gpu in data["gpus"]] == [(i, 0) for i in range(8)]
    assert data["links"][0] == ["X"] + ["NV18"] * 7 and data["links"][7][7] == "X"
    assert [nic["name"] for nic in data["nics"]] == [f"mlx5_{k}" for k in range(12)]
    port = data["ib_ports"][0]
    assert {key: port[key] for key in ("device", "port", "state", "rate_gbps", "link_layer")} == {
        "device": "mlx5_0", "port": 1, "state": "ACTIVE", "rate_gbps": 400.0,
        "link_layer": "InfiniBand"}


def test_parse_one_source_at_a_time():
    data = tpserve_json("parse", "--nvidia-smi", PCIE_TOPO)
    assert data["links"] == [["X", "PHB"], ["PHB", "X"]] and data["ib_ports"] == []
    data = tpserve_json("parse", "--ibstat", A100_IBSTAT)
    assert data["gpus"] == [] and len(data["ib_ports"]) == 9


def test_parse_text_output_shows_the_matrix():
    done = tpserve("parse", "--nvidia-smi", PCIE_TOPO)
    assert done.returncode == 0, done.stderr
    assert "GPU1    PHB     X       0" in done.stdout


def test_plan_spanning_two_h100_nodes():
    data = tpserve_json("plan", "--node", f"a={H100_TOPO},{H100_IBSTAT}",
                        "--node", f"b={H100_TOPO},{H100_IBSTAT}", "--tp", "16")
    assert data["groups"] == [[{"node": n, "device": d} for n in "ab" for d in range(8)]]
    assert isinstance(data["explanation"], list)
    assert "spans 2 nodes over IB at 400 Gb/s" in data["explanation"][0]


def test_plan_within_nodes_with_a_group_count():
    data = tpserve_json("plan", "--node", f"a={PCIE_TOPO},{A100_IBSTAT}",
                        "--node", f"b={PCIE_TOPO}", "--tp", "2", "--groups", "1")
    assert data["groups"] == [[{"node": "a", "device": 0}, {"node": "a", "device": 1}]]
    assert data["left_out"] == [{"node": "b", "devices": [0, 1],
                                 "reason": "not needed: 1 group(s) requested"}]


def test_plan_from_an_ibstat_that_failed_partway_warns_naming_the_device(tmp_path):
    text = A100_IBSTAT.read_text(encoding="utf-8")
    truncated = tmp_path / "ibstat.txt"
    truncated.write_text(text[:text.index("CA 'mlx5_5'")] + "ibpanic: [2137592] main: stat of "
                         "IB device 'mlx5_5' failed: No such file or directory\n")
    data = tpserve_json("plan", "--node", f"a={PCIE_TOPO},{truncated}", "--tp", "2")
    (warning,) = data["warnings"]
    assert warning.startswith("a: ibstat: line ") and "mlx5_5" in warning
    assert data["explanation"][-1] == f"warning: {warning}"
    done = tpserve("plan", "--node", f"a={PCIE_TOPO},{truncated}", "--tp", "2")
    assert "warning: a: ibstat" in done.stdout and "'mlx5_5'" in done.stdout


def test_plan_without_a_valid_grouping_fails_clearly():
    done = tpserve("plan", "--node", f"a={PCIE_TOPO},{A100_IBSTAT}", "--node", f"b={PCIE_TOPO}",
                   "--tp", "4", "--json")
    assert done.returncode == 2 and done.stdout == ""
    assert "no valid grouping of TP 4" in done.stderr
    assert "b [0, 1]: no active InfiniBand or RoCE port" in done.stderr


@pytest.mark.parametrize("args, words", [
    (["plan", "--node", "a", "--tp", "2"], "--node 'a': expected NAME=NVSMI_FILE"),
    (["plan", "--node", "a=/no/such/file", "--tp", "2"], "/no/such/file: cannot read"),
    (["plan", "--node", f"a={A100_IBSTAT}", "--tp", "2"],
     "ibstat_a100_all_active.txt: nvidia-smi topo -m: line 2: cannot read \"CA 'mlx5_0'\""),
    (["plan", "--node", f"a={PCIE_TOPO}", "--tp", "0"], "tp_size must be a positive integer"),
    (["parse"], "nothing to parse"),
])
def test_bad_input_exits_2_naming_it(args, words):
    done = tpserve(*args)
    assert done.returncode == 2
    assert words in done.stderr and "Traceback" not in done.stderr


def test_garbage_file_names_the_line(tmp_path):
    garbage = tmp_path / "topo.txt"
    garbage.write_text("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\t???\t X \n")
    done = tpserve("parse", "--nvidia-smi", garbage)
    assert done.returncode == 2
    assert f"{garbage}: nvidia-smi topo -m: line 3: cannot read" in done.stderr


def test_probe_this_node():
    env = {"TPSERVE_TOPOLOGY_NVSMI_FILE": "", "TPSERVE_TOPOLOGY_IBSTAT_FILE": ""}
    data = tpserve_json("probe", env=env)
    assert data["num_cpu_cores"] >= 1 and isinstance(data["gpus"], list)
    done = tpserve("probe", env=env)
    assert done.returncode == 0 and done.stdout.startswith("node ")


def test_probe_follows_the_fixture_variables():
    data = tpserve_json("probe", env={"TPSERVE_TOPOLOGY_NVSMI_FILE": str(H100_TOPO),
                                      "TPSERVE_TOPOLOGY_IBSTAT_FILE": str(H100_IBSTAT)})
    assert len(data["gpus"]) == 8 and len(data["ib_ports"]) == 9
