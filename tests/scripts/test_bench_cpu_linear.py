"""scripts/bench_cpu_linear.py: the bf16 linear kernel and oneDNN timed on the same passes over a
model's layer linears, both within bf16 rounding of an fp32 product, the JSON last line; bad
flags; a clean refusal where the kernel does not run."""

from __future__ import annotations

import json

import pytest

from bench_scripts import assert_one_line_error, run_script
from parallel.cpu_capability import cpu_bf16_support


@pytest.mark.skipif(cpu_bf16_support().path not in ("amx", "avx512_bf16"),
                    reason="the kernel needs AVX-512 BF16")
def test_times_the_kernel_and_onednn_and_ends_with_json():
    result = run_script("bench_cpu_linear", "--rows", "3,9", "--threads", "1", "--layers", "2",
                        "--reps", "2", "--hidden", "64", "--intermediate", "96", "--heads", "2",
                        "--kv-heads", "1", "--head-dim", "32", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["shapes"] == [[128, 64], [64, 64], [192, 64], [64, 96]]
    assert [(case["rows"], case["threads"]) for case in figures["cases"]] == [(3, 1), (9, 1)]
    for case in figures["cases"]:
        assert case["kernel_ms"] > 0 and case["onednn_ms"] > 0
        assert case["onednn_over_kernel"] == pytest.approx(
            case["onednn_ms"] / case["kernel_ms"], rel=0.02)
        assert case["kernel_max_error"] <= 2 ** -8 and case["onednn_max_error"] <= 2 ** -8


def test_refuses_cleanly_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.setenv("TPSERVE_CPU_KERNELS", "0")
    assert_one_line_error(run_script("bench_cpu_linear", "--rows", "1", timeout=60),
                          "the bf16 linear kernel does not run here", returncode=2)


@pytest.mark.parametrize("args, expected", [
    (("--rows", "0"), "--rows must be positive"),
    (("--layers", "0"), "--threads, --layers, --reps and --rounds must be at least 1"),
    (("--hidden", "0"), "--hidden, --intermediate, --heads, --kv-heads and --head-dim must be"),
])
def test_bad_flags_exit_2_naming_them(args, expected):
    result = run_script("bench_cpu_linear", *args, timeout=60)
    assert result.returncode == 2 and expected in result.stderr
