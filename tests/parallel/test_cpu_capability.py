"""The bf16 rule on CPU flags (AMX, then AVX-512 BF16, else none) and the probe of this CPU."""

import pytest
import torch

from parallel.cpu_capability import (bf16_path, cpu_bf16_support, probe_support,
                                     read_cpu_flags)

SAPPHIRE_RAPIDS = "fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8".split()
ZEN4 = "fpu avx2 avx512f avx512bw avx512_bf16".split()
SKYLAKE_X = "fpu avx2 avx512f avx512bw avx512vl".split()


@pytest.mark.parametrize("flags, want", [
    (SAPPHIRE_RAPIDS, "amx"),
    (ZEN4, "avx512_bf16"),
    (SKYLAKE_X, None),  # AVX-512 without BF16: oneDNN converts to fp32
    (["amx_tile", "avx2"], None),  # tiles without bf16 (int8 only)
    (["amx_bf16", "amx_tile"], "amx"),
    ([], None),
])
def test_bf16_path_follows_the_flags(flags, want):
    assert bf16_path(flags) == want
    assert probe_support(frozenset(flags)).is_fast is (want is not None)


def test_flags_are_read_from_a_cpuinfo_file(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512_bf16 sse\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(str(cpuinfo)) == frozenset({"fpu", "avx512_bf16", "sse"})
    assert read_cpu_flags(str(tmp_path / "absent")) is None
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert read_cpu_flags(str(tmp_path / "arm")) is None


def test_without_flags_onednn_decides_and_says_so():
    support = probe_support(None)
    assert support.is_fast is support.onednn_bf16
    assert support.path in ("onednn", None) and not support.flags_known
    assert "oneDNN's answer" in support.describe()


def test_this_cpu_is_described_with_what_torch_reports():
    support = cpu_bf16_support()
    line = support.describe()
    assert support.cpu_capability == torch.backends.cpu.get_cpu_capability() in line
    assert ("mkldnn available" in line) is torch.backends.mkldnn.is_available()
    assert support.flags_known is (read_cpu_flags() is not None)
