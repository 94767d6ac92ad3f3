"""scripts/bench_serve.py: both routers end to end on a tiny checkpoint (slow, Ray), its errors on
bad trace files, and its pure parts (scaling, shared Mooncake prefixes, /metrics). The trace
readers' own tests are in test_traces.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench_scripts import load_script, run_script, script_path

SCRIPT = script_path("bench_serve")

REQUIRED_KEYS = (
    "ttft_p99_ms", "ttft_p99_ms_pow2", "ttft_p50_ms", "ttft_p50_ms_pow2", "itl_p99_ms",
    "itl_p99_ms_pow2", "throughput_tok_s", "throughput_tok_s_pow2", "router_decision_us_p50",
    "rank_groups_us_p50_64_groups", "num_ok", "num_ok_pow2", "num_failed", "num_failed_pow2",
    "num_not_sent", "num_not_sent_pow2", "prompt_scale", "max_output", "num_requests", "wall_s",
    "other_cpu_frac", "other_cpu_frac_pow2",
)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_serve")


def run_bench(*args: str, timeout: int = 600):
    return run_script("bench_serve", *args, timeout=timeout)


def write_azure(path: Path, rows) -> Path:
    lines = [f"2023-11-16 18:17:0{i}.5000000,{c},{g}\n" for i, (c, g) in enumerate(rows)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(lines))
    return path


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_both_routers_print_sane_json_last(tmp_path, tiny_llama):
    trace = write_azure(tmp_path / "trace.csv", [(800, 10), (40, 2), (1600, 3), (300, 30)])
    proc = run_bench("--model", str(tiny_llama), "--trace", str(trace), "--num-requests", "4",
                     "--rate", "20", "--kv-blocks", "64")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(REQUIRED_KEYS) <= set(result), set(REQUIRED_KEYS) - set(result)
    assert "kv-aware" in proc.stdout and "scaling: prompts / 16" in proc.stdout
    for suffix in ("", "_pow2"):
        assert result["num_ok" + suffix] == 4 and result["num_failed" + suffix] == 0
        assert result["num_not_sent" + suffix] == 0
        # 10 + 2 + 3 + 30 tokens, capped at 32 each: every request generated all of its own
        assert result["output_tokens" + suffix] == 45
        assert result["throughput_tok_s" + suffix] > 0
        assert 0 < result["ttft_p50_ms" + suffix] <= result["ttft_p99_ms" + suffix] < 60_000
        assert 0 < result["itl_p99_ms" + suffix] < 60_000
    assert result["router_decision_source"].startswith("live")
    assert sum(result["router_decisions_by_reason"].values()) == 4
    assert result["num_router_decisions"] == 4
    assert 0 < result["router_decision_us_p50"] < 100_000
    assert result["model"] == "llama" and result["prompt_scale"] == 16


@pytest.mark.parametrize("content, expected", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,abc,10\n", "line 2"),
    ("time,prompt,output\n1,2,3\n", "expected an Azure CSV"),
    ('{"timestamp": 0, "input_length": 10}\n', "line 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,-1,10\n", "negative"),
])
def test_malformed_trace_exits_nonzero_naming_the_file(tmp_path, content, expected):
    trace = tmp_path / "bad_trace.txt"
    trace.write_text(content)
    proc = run_bench("--trace", str(trace), "--num-requests", "1", timeout=60)
    assert proc.returncode == 2
    assert str(trace) in proc.stderr and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_workload_scales_caps_and_shares_mooncake_prefixes(bench):
    rows = [bench.TraceRequest(0.0, n, o, h)
            for n, o, h in [(1024, 100, (7, 8)), (1000, 3, (7, 8)), (600, 9, (7, 9))]]
    scaling = bench.Scaling(prompt_scale=16, max_output=32, arrival="poisson", rate_req_s=2.0,
                            time_scale=1.0)
    reqs = bench.build_workload(rows, scaling, vocab_size=509, max_model_len=256, seed=0)
    assert [len(r.prompt_ids) for r in reqs] == [64, 63, 38]
    assert [r.max_tokens for r in reqs] == [32, 3, 9]
    assert reqs[0].prompt_ids[:63] == reqs[1].prompt_ids  # hash ids 7, 8: 32 tokens each
    assert reqs[0].prompt_ids[:32] == reqs[2].prompt_ids[:32]  # hash id 7 only
    assert reqs[0].prompt_ids[32:38] != reqs[2].prompt_ids[32:38]
    assert all(100 <= t < 509 for r in reqs for t in r.prompt_ids)
    again = bench.build_workload(rows, scaling, vocab_size=509, max_model_len=256, seed=0)
    assert again == reqs  # the same load for both routers
    assert reqs[0].arrival_s == 0.0 and reqs[1].arrival_s < reqs[2].arrival_s


def test_lengths_fit_the_context(bench):
    row = bench.TraceRequest(0.0, 100_000, 5_000)
    scaling = bench.Scaling(16, 32, "trace", None, 4.0)
    (req,) = bench.build_workload([row], scaling, vocab_size=509, max_model_len=256, seed=1)
    assert req.max_tokens == 32 and len(req.prompt_ids) == 256 - 32


def test_trace_arrivals_are_sped_up(bench):
    rows = [bench.TraceRequest(t, 16, 1) for t in (0.0, 2.0, 6.0)]
    scaling = bench.Scaling(16, 32, "trace", None, 2.0)
    assert bench.arrival_times(rows, scaling, random.Random(0)) == [0.0, 1.0, 3.0]


def test_group_metrics_are_read_from_metrics_text(bench):
    text = (
        "# TYPE tpserve:kv_cache_usage_perc gauge\n"
        'tpserve:kv_cache_usage_perc{group="a",model_name="m"} 0.25\n'
        'tpserve:kv_cache_usage_perc{group="b",model_name="m"} 0.5\n'
        "# TYPE tpserve:num_preemptions counter\n"
        'tpserve:num_preemptions_total{group="a",model_name="m"} 2.0\n'
        'tpserve:num_preemptions_total{group="b",model_name="m"} 1.0\n'
        "# TYPE tpserve:prefix_cache_hits counter\n"
        'tpserve:prefix_cache_hits_total{group="a",model_name="m"} 4.0\n'
    )
    usage, counters = bench.parse_group_metrics(text)
    assert usage == {"a": 0.25, "b": 0.5}
    assert counters == {"a": {"num_preemptions": 2.0, "prefix_cache_hits": 4.0},
                        "b": {"num_preemptions": 1.0}}


def test_summary_counts_failures_and_percentiles(bench):
    ok = bench.RequestResult(4, sent_at=0.0, ended_at=2.0, ttft_s=0.5, itl_s=[0.1, 0.2, 0.3],
                             num_streamed_tokens=4, num_output_tokens=4)
    failed = bench.RequestResult(4, sent_at=0.5, ended_at=1.0, error="APIError")
    run = bench.RunResult("kv", [ok, failed, bench.RequestResult(3)], num_not_sent=1, start=0.0,
                          group_counters={"a": {"prefix_cache_queries": 30.0},
                                          "b": {"prefix_cache_queries": 10.0,
                                                "prefix_cache_hits": 10.0}})
    summary = bench.summarize(run)
    assert summary["prefill_tokens_by_group"] == [10, 30] and summary["prefix_hit_rate"] == 0.25
    assert summary["num_ok"] == 1 and summary["num_failed"] == 1 and summary["num_sent"] == 2
    assert summary["failures"] == {"APIError": 1} and summary["num_not_sent"] == 1
    assert summary["throughput_tok_s"] == 2.0 and summary["ttft_p99_ms"] == 500.0
    assert summary["itl_p50_ms"] == 200.0


def test_rank_groups_is_timed(bench):
    assert 0 < bench.time_rank_groups(4, num_calls=50) < 10_000


def test_cpu_of_other_processes_is_a_fraction_of_the_machine(bench, monkeypatch):
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    # 2 s of wall time, 3 CPU-seconds busy on the machine, 1 of them ours: 2 of 4 elsewhere
    assert bench.other_cpu_frac((10.0, 100.0, 5.0), (12.0, 103.0, 6.0)) == 0.5
    assert bench.other_cpu_frac(None, (12.0, 103.0, 6.0)) is None
    snapshot = bench.cpu_snapshot()
    assert snapshot is None or (snapshot[1] > 0 and snapshot[2] >= 0)
