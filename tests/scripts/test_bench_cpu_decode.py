"""scripts/bench_cpu_decode.py: the C decode kernel and the PyTorch path it replaces timed hot
and cold on the same decodes, their outputs equal, the JSON last line; bad flags."""

from __future__ import annotations

import json

import pytest

from bench_scripts import run_script


def test_times_the_kernel_and_the_pytorch_path_and_ends_with_json():
    result = run_script("bench_cpu_decode", "--seqs", "20", "--layers", "3", "--reps", "2",
                        "--max-keys", "90", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["max_abs_error"] < 1e-4  # the same attention, both ways
    assert figures["seqs"] == 20 and figures["kv_bytes_per_layer"] > 20 * 41 * 2 * 3 * 64 * 4
    for mode in ("hot", "cold"):
        kernel, pytorch = figures[f"kernel_us_{mode}"], figures[f"pytorch_us_{mode}"]
        assert kernel > 0 and pytorch > 0
        assert figures[f"pytorch_over_kernel_{mode}"] == pytest.approx(pytorch / kernel, rel=0.01)
    assert "pytorch/kernel" in result.stdout


@pytest.mark.parametrize("args, expected", [
    (("--seqs", "0"), "--seqs must be at least 1"),
    (("--min-keys", "50", "--max-keys", "10"), "--max-keys must be at least --min-keys"),
    (("--heads", "9", "--kv-heads", "2"), "--kv-heads 2 must divide --heads 9"),
])
def test_bad_flags_exit_2_naming_them(args, expected):
    result = run_script("bench_cpu_decode", *args, timeout=60)
    assert result.returncode == 2 and expected in result.stderr
