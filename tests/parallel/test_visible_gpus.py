"""A node's GPUs are those of its raylet's CUDA_VISIBLE_DEVICES: the probe (NVML, nvidia-smi)
sees every GPU of the host, and drops the others before planning."""

from pathlib import Path

import pytest

from parallel import topology_probe
from parallel.topology_parse import parse_nvidia_smi_topo

DATA = Path(__file__).resolve().parents[1] / "data" / "topology"
H100_TOPO = DATA / "nvidia-smi-topo_h100x8_nv18_12nic.txt"


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_gpus_outside_the_raylets_visible_devices_are_not_planned():
    # Two Ray nodes on one 8-GPU host (CUDA_VISIBLE_DEVICES 0-3 and 4-7): each node's probe
    # sees all 8 through NVML or nvidia-smi, and must plan only its own.
    full = parse_nvidia_smi_topo(_read(H100_TOPO))
    mine = topology_probe.restrict_to_visible(full, "4,5,6,7")
    assert [int(g.index) for g in mine.gpus] == [4, 5, 6, 7]
    assert mine.links == tuple(tuple(full.links[i][j] for j in range(4, 8)) for i in range(4, 8))
    assert [nic.gpu_links for nic in mine.nics] == [nic.gpu_links[4:] for nic in full.nics]
    assert "GPU(s) [0, 1, 2, 3] are outside this node's CUDA_VISIBLE_DEVICES" in mine.warnings[-1]


@pytest.mark.parametrize("visible", [None, "", " ", "0,1,2,3,4,5,6,7"])
def test_no_restriction_or_every_gpu_visible_plans_them_all(visible):
    full = parse_nvidia_smi_topo(_read(H100_TOPO))
    assert topology_probe.restrict_to_visible(full, visible) == full


def test_visible_devices_by_uuid_restrict_nothing_and_say_so():
    full = parse_nvidia_smi_topo(_read(H100_TOPO))
    mine = topology_probe.restrict_to_visible(full, "GPU-8c3f1d2e-aaaa-bbbb-cccc-1234567890ab")
    assert mine.gpus == full.gpus and "UUID or MIG id" in mine.warnings[-1]
