"""scripts/bench_cpu_prefill.py: the CPU prefill kernel and the SDPA path it replaces timed on the
same prefill, both within bf16 rounding of fp32 SDPA, the JSON last line; bad flags; a clean
refusal where the kernel does not run."""

from __future__ import annotations

import json

import pytest

from bench_scripts import assert_one_line_error, run_script
from parallel.cpu_capability import cpu_bf16_support


@pytest.mark.skipif(cpu_bf16_support().path not in ("amx", "avx512_bf16"),
                    reason="the kernel needs AMX or AVX-512 BF16")
def test_times_the_kernel_and_sdpa_and_ends_with_json():
    result = run_script("bench_cpu_prefill", "--lengths", "40", "--prefix", "24", "--threads", "1",
                        "--reps", "2", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    (case,) = figures["cases"]
    assert case["length"] == 40 and case["threads"] == 1 and figures["prefix"] == 24
    assert figures["products"] == cpu_bf16_support().path
    assert case["kernel_us"] > 0 and case["sdpa_us"] > 0
    assert case["sdpa_over_kernel"] == pytest.approx(case["sdpa_us"] / case["kernel_us"], rel=0.01)
    assert case["kernel_max_error"] < 2e-2 and case["sdpa_max_error"] < 2e-2


def test_refuses_cleanly_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.setenv("TPSERVE_CPU_KERNELS", "0")
    assert_one_line_error(run_script("bench_cpu_prefill", "--lengths", "8", timeout=120),
                          "the CPU prefill kernel does not run here", returncode=2)


@pytest.mark.parametrize("args, expected", [
    (("--lengths", "0"), "--lengths must be positive"),
    (("--threads", "0"), "--threads, --reps and --rounds must be at least 1"),
    (("--heads", "9", "--kv-heads", "2"), "--heads (9) must be a multiple of --kv-heads (2)"),
    (("--head-dim", "96"), "invalid choice"),
])
def test_bad_flags_exit_2_naming_them(args, expected):
    result = run_script("bench_cpu_prefill", *args, timeout=60)
    assert result.returncode == 2 and expected in result.stderr
