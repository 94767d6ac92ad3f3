"""scripts/cpu_bf16_drift.py: the drift figures of bf16 on the GPU check's tiny Llama, as JSON
last; bad flags and a missing model exit 2 naming them."""

from __future__ import annotations

import json

import pytest

from bench_scripts import run_script


def test_the_tiny_model_drifts_little_and_fp32_not_at_all():
    result = run_script("cpu_bf16_drift", "--models", "tiny", "--max-new", "4", timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])["tiny"]
    assert set(figures) == {"tpserve-bf16 vs hf-bf16", "tpserve-bf16 vs hf-fp32",
                            "tpserve-fp32 vs hf-fp32"}
    assert figures["tpserve-fp32 vs hf-fp32"]["token_mismatch_rate"] == 0.0
    assert figures["tpserve-bf16 vs hf-bf16"]["first_token_mismatch_rate"] <= 1 / 3


@pytest.mark.parametrize("args, expected", [
    (("--max-new", "0"), "--max-new must be at least 1"),
    (("--models", " , "), "--models: expected at least one model"),
    (("--models", "/no/such/checkpoint"), "--models /no/such/checkpoint"),
])
def test_bad_flags_exit_2_naming_them(args, expected):
    result = run_script("cpu_bf16_drift", *args, timeout=60)
    assert result.returncode == 2 and expected in result.stderr, result.stderr[-2000:]
