"""scripts/bench_engine.py: end to end on a tiny checkpoint, its errors on bad trace files, and
its pure parts (length clamping, the roofline's byte and FLOP counts). The trace reader's own
tests are in test_traces.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench_scripts import load_script, run_script, script_path

from workers.engine import StepRecord
from workers.model_config import load_model_config

SCRIPT = script_path("bench_engine")

REQUIRED_KEYS = (
    "tokens_per_s", "total_tokens_per_s", "hf_generate_tokens_per_s", "hf_cb_tokens_per_s",
    "ratio_vs_hf_generate", "ratio_vs_hf_cb", "roofline_frac", "kv_waste_frac", "model", "tp",
    "num_requests", "decode_tokens_per_s", "decode_ratio_vs_hf_generate", "decode_ratio_vs_hf_cb",
    "decode_roofline_frac", "decode_kv_waste_frac", "read_gbps", "matmul_gflops",
)
PER_WORKLOAD_RATES = ("tokens_per_s", "total_tokens_per_s", "hf_generate_tokens_per_s",
                      "hf_cb_tokens_per_s", "ratio_vs_hf_generate", "ratio_vs_hf_cb",
                      "roofline_frac")


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_engine")


def run_bench(*args: str, timeout: int = 300):
    return run_script("bench_engine", *args, timeout=timeout)


def write_trace(path: Path, rows) -> Path:
    lines = [f"2023-11-16 18:17:0{i}.0,{c},{g}\n" for i, (c, g) in enumerate(rows)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(lines))
    return path


@pytest.mark.slow
def test_bench_prints_sane_json_last(tmp_path, tiny_llama):
    trace = write_trace(tmp_path / "trace.csv", [(800, 10), (40, 2), (1600, 3), (8, 30)])
    proc = run_bench("--model", str(tiny_llama), "--trace", str(trace), "--num-requests", "4",
                     "--decode-requests", "3", "--max-output", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(REQUIRED_KEYS) <= set(result)
    assert result["model"] == "llama" and result["tp"] == 1 and result["num_requests"] == 4
    for key in PER_WORKLOAD_RATES + tuple(f"decode_{k}" for k in PER_WORKLOAD_RATES):
        assert result[key] > 0, key
    assert result["read_gbps"] > 0 and result["matmul_gflops"] > 0
    assert 0 <= result["kv_waste_frac"] < 1 and 0 <= result["decode_kv_waste_frac"] < 1
    # Prompts 800, 40, 1600, 8 scaled by 1/8; outputs 10, 2, 3, 30 capped at 4; every system
    # generated exactly those counts.
    assert result["prompt_tokens"] == 100 + 5 + 200 + 1
    for prefix, expected in (("", 4 + 2 + 3 + 4), ("decode_", 3 * 4)):
        for key in ("output_tokens", "hf_generate_output_tokens", "hf_cb_output_tokens"):
            assert result[f"{prefix}{key}"] == expected, key
    assert "machine limit" in proc.stdout and "hf_cb" in proc.stdout
    assert result["cpu_decode_kernel"] is True and "CPU decodes: the C kernel" in proc.stdout


def test_malformed_trace_exits_nonzero_naming_the_file(tmp_path):
    trace = tmp_path / "bad_trace.csv"
    trace.write_text("time,prompt,output\n1,2,3\n")
    proc = run_bench("--trace", str(trace), "--num-requests", "1", "--skip-hf", timeout=120)
    assert proc.returncode != 0
    assert str(trace) in proc.stderr and "expected an Azure CSV" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_clamp_lengths_fits_the_context(bench):
    from scripts.engine.workloads import clamp_lengths
    assert clamp_lengths(0, 0, 100, None) == (1, 1)
    assert clamp_lengths(500, 20, 100, None) == (80, 20)
    assert clamp_lengths(10, 500, 100, None) == (1, 99)
    assert clamp_lengths(10, 50, 100, 8) == (10, 8)


def test_roofline_counts_bytes_and_flops(bench, tiny_llama):
    m = load_model_config(tiny_llama)  # hidden 64, inter 96, 2 layers, 4 heads, 2 KV, hd 16
    cost = bench.ModelCost.of(m, 4)
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96
    assert cost.linear_params == 2 * per_layer
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    # One prefill of 3 new tokens on 2 cached ones, one decode on 5 cached: 2 logits.
    step = StepRecord(seqs=((2, 3), (5, 1)), num_logits=2, duration_s=1.0)
    pairs = (3 * 2 + 3 * 4 // 2) + (1 * 5 + 1)
    assert cost.step_flops(step) == (2 * cost.linear_params * 4 + 2 * 509 * 64 * 2
                                     + 4 * 2 * 4 * 16 * pairs)
    assert cost.step_bytes(step) == ((cost.linear_params + 509 * 64) * 4
                                     + (5 + 6) * cost.kv_bytes_per_token)
    assert cost.step_limit_s(step, 1.0, 1.0) == max(cost.step_bytes(step),
                                                   cost.step_flops(step)) / 1e9
