"""scripts/bench_serve.py and its modules (serve_workload, serve_replay, serve_report): the four
routers, --rate auto and the target sweep end to end in one run on a tiny checkpoint (slow,
Ray), its errors on bad trace files, and its pure parts (scaling, shared prefixes, KV sizing,
--rate auto, /metrics, the JSON keys and targets). The trace readers' and sampler's own tests
are in test_traces.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench_scripts import load_script, run_script, script_path

SCRIPT = script_path("bench_serve")

REQUIRED_KEYS = (
    "ttft_p99_ms", "ttft_p99_ms_pow2", "ttft_p99_ms_prefix_affinity", "ttft_p99_ms_round_robin",
    "ttft_p50_ms", "ttft_p50_ms_pow2", "itl_p99_ms", "itl_p99_ms_pow2", "throughput_tok_s",
    "throughput_tok_s_pow2", "throughput_tok_s_prefix_affinity", "prefix_hit_rate",
    "prefix_hit_rate_pow2", "prefix_hit_rate_prefix_affinity", "preemptions", "preemptions_pow2",
    "preemptions_prefix_affinity", "kv_usage_peak_by_group", "kv_usage_mean_by_group_pow2",
    "router_decision_us_p50", "rank_groups_us_p50_64_groups", "num_ok", "num_ok_pow2",
    "num_failed", "num_failed_pow2", "num_not_sent", "num_not_sent_pow2", "prompt_scale",
    "max_output", "num_requests", "wall_s", "other_cpu_frac", "other_cpu_frac_pow2", "load_avg",
    "rate_req_s", "kv_blocks", "working_set_over_pool", "ideal_prefix_hit_rate",
    "ttft_p99_met_pow2", "ttft_p99_met_prefix_affinity",
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


def write_mooncake(path: Path, hash_lists, output_length: int = 3) -> Path:
    path.write_text("".join(json.dumps({
        "timestamp": 100 * i, "input_length": 512 * len(h) - 100, "output_length": output_length,
        "hash_ids": h}) + "\n" for i, h in enumerate(hash_lists)))
    return path


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_four_routers_rate_auto_and_a_target_sweep_end_to_end(tmp_path, tiny_llama):
    """One run of everything that deploys (each deployment costs seconds): --rate auto's
    calibration, the KV-aware router at two targets, the three others once as its baselines."""
    # 3 conversations of 2 turns and 2 single requests; prompts / 64: 8 tokens a hash block
    trace = write_mooncake(tmp_path / "trace.jsonl", [
        [1, 2], [3, 4, 5], [1, 2, 6], [7, 8], [3, 4, 5, 9], [10], [7, 8, 11], [12, 13]])
    plot = tmp_path / "sweep.png"
    proc = run_bench("--model", str(tiny_llama), "--trace", str(trace), "--requests", "6",
                     "--system-prompt-blocks", "2", "--block-size", "4", "--max-output", "3",
                     "--drain-timeout-s", "60", "--min-turns", "1", "--target", "0.7,0.9",
                     "--calibration-requests", "4", "--plot-out", str(plot), timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(REQUIRED_KEYS) <= set(result), set(REQUIRED_KEYS) - set(result)
    assert "kv-aware @0.9" in proc.stdout and "prefix affinity" in proc.stdout
    for suffix in ("", "_pow2", "_prefix_affinity", "_round_robin"):
        assert result["num_ok" + suffix] == 6 and result["num_failed" + suffix] == 0
        assert result["output_tokens" + suffix] == 18  # 3 tokens each, every request
        assert result["throughput_tok_s" + suffix] > 0
        assert 0 < result["ttft_p50_ms" + suffix] <= result["ttft_p99_ms" + suffix] < 60_000
        assert 0 <= result["prefix_hit_rate" + suffix] <= result["ideal_prefix_hit_rate"] <= 1
        assert len(result["kv_usage_mean_by_group" + suffix]) == 2
    assert result["num_requests"] == 6 and 3 <= result["num_conversations"] <= 4
    assert result["router_decision_source"].startswith("live")
    assert result["num_router_decisions"] == 6  # the first target's run
    assert 0 < result["router_decision_us_p50"] < 100_000
    assert result["model"] == "llama"
    # the sweep: the unsuffixed figures are the first target's
    assert result["sweep_targets"] == [0.7, 0.9]
    assert result["ttft_p99_ms_by_target"][0] == result["ttft_p99_ms"]
    assert len(result["throughput_tok_s_by_target"]) == 2
    assert "ttft_p99_ms_by_target_pow2" not in result  # run once: a baseline
    assert plot.read_bytes()[:4] == b"\x89PNG"
    # --rate auto
    assert result["rate_req_s"] == pytest.approx(0.9 * result["sustained_req_s"], rel=0.01)
    assert "--rate auto: the groups sustained" in proc.stdout


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_repeat_pools_rounds_end_to_end(tmp_path, tiny_llama):
    """--repeat 2 at a fixed rate (no calibration), one router to keep it to two deployments
    (the order's rotation is tested above): the figures pool both rounds, each round's are
    listed."""
    trace = write_mooncake(tmp_path / "trace.jsonl", [[1, 2], [1, 2, 3], [4, 5], [4, 5, 6]])
    plot = tmp_path / "ttft.png"
    proc = run_bench("--model", str(tiny_llama), "--trace", str(trace), "--requests", "4",
                     "--system-prompt-blocks", "1", "--block-size", "4", "--max-output", "2",
                     "--drain-timeout-s", "60", "--min-turns", "1", "--rate", "4",
                     "--routers", "kv", "--repeat", "2", "--plot-out", str(plot), timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rounds"] == 2 and "sustained_req_s" not in result
    assert result["num_ok"] == 8 and result["output_tokens"] == 16
    assert result["num_failed_by_round"] == [0, 0]
    assert len(result["ttft_p99_ms_by_round"]) == 2
    assert all(t > 0 for t in result["ttft_p99_ms_by_round"])
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert result["num_router_decisions"] == 8  # both rounds' live decisions
    assert result["ttft_p99_met_prefix_affinity_rounds"] is None  # no baseline ran
    assert "round 2 (ran kv)" in proc.stdout and "kv-aware, round 2/2" in proc.stderr
    assert plot.read_bytes()[:4] == b"\x89PNG"


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
                                                "prefix_cache_hits": 10.0}},
                          kv_usage_peak={"a": 0.9, "b": 0.5}, kv_usage_sum={"a": 1.2, "b": 0.9},
                          kv_usage_samples={"a": 2, "b": 3})
    summary = bench.summarize(run)
    assert summary["kv_usage_peak_by_group"] == [0.5, 0.9]  # lowest peak first
    assert summary["kv_usage_mean_by_group"] == [0.3, 0.6] and summary["kv_usage_peak"] == 0.9
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


def test_a_shared_system_prompt_goes_in_front_of_every_prompt(bench):
    rows = [bench.TraceRequest(0.0, 700, 3, (7, 8)), bench.TraceRequest(1.0, 512, 2, (9,))]
    with_prompt = bench.with_system_prompt(rows, 2)
    assert [r.hash_ids for r in with_prompt] == [(-1, -2, 7, 8), (-1, -2, 9)]
    assert [r.num_prompt_tokens for r in with_prompt] == [1724, 1536]
    assert bench.with_system_prompt(rows, 0) == rows


def test_working_set_counts_shared_full_blocks_once(bench):
    reqs = [bench.BenchRequest([1, 2, 3, 4, 5], 3, 0.0), bench.BenchRequest([1, 2, 3, 4], 4, 0.0),
            bench.BenchRequest([9, 2, 3, 4, 5], 1, 0.0)]
    # block size 2: full blocks (1,2) (3,4) shared by the first two, (9,2) (3,4) apart (another
    # prefix); own blocks: ceil((1+3)/2) = 2, ceil((0+4)/2) = 2, ceil((1+1)/2) = 1
    assert bench.working_set_blocks(reqs, 2) == 4 + 5
    assert bench.longest_request_blocks(reqs, 2) == 4


def test_ideal_hit_rate_counts_leading_blocks_seen_before_leaving_one_token(bench):
    first = list(range(10))  # block size 4: full blocks [0-3] [4-7]; 2 may be looked up
    reqs = [bench.BenchRequest(first, 1, 0.0),
            bench.BenchRequest(first[:8] + [50, 51, 52, 53, 54], 1, 1.0),  # 2 blocks hit: 8
            bench.BenchRequest(first[:8], 1, 2.0),  # (8 - 1) // 4 = 1 block looked up: 4
            bench.BenchRequest([60, 61, 62, 63] + first[4:8], 1, 3.0)]  # [4-7] after another
    assert bench.ideal_hit_rate(reqs, 4) == pytest.approx((8 + 4) / (10 + 13 + 8 + 8))
    assert bench.ideal_hit_rate(reqs[:1], 4) == 0.0 and bench.ideal_hit_rate([], 4) == 0.0


def test_auto_kv_blocks_puts_the_working_set_over_the_pool(bench):
    assert bench.auto_kv_blocks(1000, 100, 2.0) == (500, "working set 1000 blocks / 2")
    blocks, why = bench.auto_kv_blocks(1000, 300, 2.0)
    assert blocks == 600 and "2 x the longest request" in why


def test_rate_auto_is_the_load_times_the_sustained_rate(bench):
    assert bench.sustained_rate(30, 12.0) == 2.5
    assert bench.poisson_rate(2.5, 0.9) == pytest.approx(2.25)
    with pytest.raises(ValueError, match="positive duration"):
        bench.sustained_rate(30, 0.0)
    with pytest.raises(ValueError, match="--load"):
        bench.poisson_rate(2.5, 0.0)
    reqs = [bench.BenchRequest([i], 1, float(i)) for i in range(10)]
    sample = bench.calibration_sample(reqs, 4)
    assert [r.prompt_ids for r in sample] == [[0], [2], [5], [7]]
    assert all(r.arrival_s == 0.0 for r in sample)
    timed = bench.with_rate(reqs, 5.0, seed=0)
    assert [r.prompt_ids for r in timed] == [r.prompt_ids for r in reqs]
    assert timed[0].arrival_s == 0.0 and 0.5 < timed[-1].arrival_s < 5.0  # 9 gaps of 0.2 s


def test_rate_and_sizes_take_auto_or_a_number(bench):
    args = bench.parse_args([])
    assert args.rate is None and args.kv_blocks is None and args.targets == [0.7]
    assert args.routers == ["kv", "pow2", "prefix_affinity", "round_robin"]
    args = bench.parse_args(["--rate", "1.5", "--kv-blocks", "300", "--target", "0.5,0.9",
                             "--requests", "40"])
    assert (args.rate, args.kv_blocks, args.targets) == (1.5, 300, [0.5, 0.9])
    assert args.calibration_requests == 10
    assert bench.parse_args(["--min-turns", "3"]).min_turns == 3
    assert bench.parse_args(["--routers", "kv,pow2", "--target", "0.5,0.9"]).targets
    for bad in (["--rate", "fast"], ["--routers", "kv,random"], ["--target", "1.5"],
                ["--min-turns", "0"], ["--routers", "pow2", "--target", "0.5,0.9"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_host_tier_reaches_every_groups_engine(bench, tiny_llama):
    work = bench.Workload([], {"kv_blocks": 32}, 100, tiny_llama)
    args = bench.parse_args(["--host-kv-blocks", "64"])
    assert bench.serve_config(args, work, 0.7).engine.host_kv_blocks == 64
    assert bench.serve_config(bench.parse_args([]), work, 0.7).engine.host_kv_blocks is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--host-kv-blocks", "-1"])


def fake_summary(ttft_p99, throughput, hit_rate, preemptions):
    return {"ttft_p99_ms": ttft_p99, "throughput_tok_s": throughput,
            "prefix_hit_rate": hit_rate, "preemptions": preemptions}


def test_json_keys_and_targets(bench):
    summary = {"kv": fake_summary(700.0, 30.0, 0.5, 0),
               "pow2": fake_summary(1000.0, 29.0, 0.3, 4),
               "prefix_affinity": fake_summary(690.0, 30.0, 0.5, 1),
               "round_robin": fake_summary(1200.0, 28.0, 0.2, 6)}
    checks = bench.target_checks(summary)
    assert checks["ttft_p99_met_pow2"] and checks["throughput_met_pow2"]
    assert checks["prefix_hit_rate_met_pow2"] and checks["preemptions_met_pow2"]
    assert checks["ttft_p99_met_prefix_affinity"] is False  # 700 > 690
    assert checks["preemptions_met_prefix_affinity"] is True
    summary["pow2"]["ttft_p99_ms"] = 850.0  # 700 / 850 = 0.82: not 20% lower
    assert bench.target_checks(summary)["ttft_p99_met_pow2"] is False
    assert bench.target_checks({"kv": summary["kv"]})["ttft_p99_met_pow2"] is None
    out = bench.flat_json(summary, {"router": {"router_decision_us_p50": 40.0}, "groups": 2})
    for key in ("ttft_p99_ms", "ttft_p99_ms_pow2", "ttft_p99_ms_prefix_affinity",
                "throughput_tok_s", "throughput_tok_s_pow2", "prefix_hit_rate",
                "prefix_hit_rate_pow2", "preemptions", "preemptions_pow2",
                "router_decision_us_p50", "preemptions_round_robin", "groups"):
        assert key in out, key
    assert out["ttft_p99_ms_prefix_affinity"] == 690.0 and out["preemptions_pow2"] == 4


def test_sweep_json_and_plot(bench, tmp_path):
    summaries = [{"ttft_p50_ms": 1.0, "ttft_p99_ms": 9.0 - t, "itl_p99_ms": 2.0,
                  "throughput_tok_s": 10.0 + t, "prefix_hit_rate": 0.5, "preemptions": 0,
                  "kv_usage_peak": 0.7, "num_failed": 0, "load_avg": [1.0, 2.0]}
                 for t in range(3)]
    out = bench.sweep_json([0.5, 0.7, 0.9], summaries)
    assert out["ttft_p99_ms_by_target"] == [9.0, 8.0, 7.0]
    assert out["throughput_tok_s_by_target"] == [10.0, 11.0, 12.0]
    variant = bench.sweep_json([0.5, 0.7, 0.9], summaries, bench.json_suffix("kv_strict"))
    assert variant["ttft_p99_ms_by_target_kv_strict"] == [9.0, 8.0, 7.0]
    baseline = {**summaries[0], "ttft_p99_ms": None}  # no request finished: no line, no crash
    bench.plot_sweep([0.5, 0.7, 0.9], {"kv": summaries}, {"pow2": summaries[1], "round_robin":
                     baseline}, str(tmp_path / "p.png"), "title")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert bench.run_label("kv", 0.5) == "kv-aware @0.5"
    assert bench.run_label("pow2") == "pow2 (default)"


# ----- --repeat: rounds, pooled -----


def test_round_orders_rotate_so_each_router_takes_each_place(bench):
    orders = bench.round_orders(["kv", "pow2", "prefix_affinity"], 4)
    assert orders == [["kv", "pow2", "prefix_affinity"], ["pow2", "prefix_affinity", "kv"],
                      ["prefix_affinity", "kv", "pow2"], ["kv", "pow2", "prefix_affinity"]]


def _round(bench, start, ttfts, tokens, hits, queries, peaks, decisions):
    """A round whose requests are sent 1 s apart from ``start`` and each last 2 s."""
    results = [bench.RequestResult(tokens, sent_at=start + i, ended_at=start + i + 2.0,
                                   ttft_s=t, itl_s=[0.01], num_streamed_tokens=tokens,
                                   num_output_tokens=tokens) for i, t in enumerate(ttfts)]
    names = [f"g{start}-{i}" for i in range(len(peaks))]  # each deployment names its own
    return bench.RunResult(
        "kv", results, num_not_sent=1, start=start,
        kv_usage_peak=dict(zip(names, peaks)), kv_usage_sum=dict(zip(names, peaks)),
        kv_usage_samples={n: 1 for n in names},
        group_counters={n: {"prefix_cache_hits": h, "prefix_cache_queries": q,
                            "num_preemptions": 1.0} for n, h, q in zip(names, hits, queries)},
        router_stats={"num_routers": 1, "times_us": decisions,
                      "counts": {"under_target_prefix": len(decisions)}},
        other_cpu_frac=0.01, load_avg=[1.0, 2.0])


def test_pooled_rounds_join_their_windows_and_merge_groups_by_place(bench):
    first = _round(bench, 100.0, [0.1, 0.2], 4, [10.0, 30.0], [100.0, 100.0], [0.2, 0.6], [5.0])
    second = _round(bench, 900.0, [0.3, 0.4, 5.0], 2, [0.0, 20.0], [50.0, 50.0], [0.9, 0.1],
                    [7.0, 9.0])
    summary = bench.summarize(bench.pool_runs([first, second]))
    # windows 3 s and 4 s, not the 803 s between the rounds' clocks
    assert summary["duration_s"] == 7.0 and summary["output_tokens"] == 2 * 4 + 3 * 2
    assert summary["throughput_tok_s"] == 2.0
    assert summary["num_ok"] == 5 and summary["num_not_sent"] == 2
    assert summary["ttft_p50_ms"] == 300.0 and summary["ttft_p99_ms"] > 4000.0  # one pool
    assert summary["prefix_hit_rate"] == 0.2  # 60 hits of 300 tokens looked up
    assert summary["preemptions"] == 4
    # group places by peak usage: (0.2, 0.1) lowest, (0.6, 0.9) highest
    assert summary["kv_usage_peak_by_group"] == [0.2, 0.9]
    assert summary["kv_usage_mean_by_group"] == [0.15, 0.75]
    assert summary["prefill_tokens_by_group"] == [150, 150]
    stats = bench.pool_runs([first, second]).router_stats
    assert stats["times_us"] == [5.0, 7.0, 9.0] and stats["counts"] == {"under_target_prefix": 3}
    assert first.router_stats["times_us"] == [5.0]  # the rounds themselves are left alone
    assert first.results[0].sent_at == 100.0


def test_rounds_json_counts_the_rounds_meeting_each_target_and_plots(bench, tmp_path, capsys):
    by_round = [{"kv": fake_summary(700.0, 30.0, 0.5, 0),
                 "prefix_affinity": fake_summary(690.0, 30.0, 0.5, 0)},
                {"kv": fake_summary(600.0, 30.0, 0.6, 0),
                 "prefix_affinity": fake_summary(690.0, 29.0, 0.5, 0)}]
    checks = [bench.target_checks(s) for s in by_round]
    out = bench.rounds_json(by_round, checks)
    assert out["rounds"] == 2 and out["ttft_p99_ms_by_round"] == [700.0, 600.0]
    assert out["prefix_hit_rate_by_round_prefix_affinity"] == [0.5, 0.5]
    assert out["ttft_p99_met_prefix_affinity_rounds"] == 1
    assert out["throughput_met_prefix_affinity_rounds"] == 2
    assert out["ttft_p99_met_pow2_rounds"] is None  # no pow2 in these rounds: not checked
    bench.print_rounds(bench.round_orders(["kv", "prefix_affinity"], 2), by_round, checks, out)
    printed = capsys.readouterr().out
    assert "round 2 (ran prefix_affinity, kv): 600.0 / 690.0" in printed
    assert "missed: ttft_p99_met_prefix_affinity" in printed
    assert "ttft_p99_met_prefix_affinity 1/2" in printed and "met_pow2" not in printed
    pooled = {"kv": _round(bench, 0.0, [0.1, 0.2], 4, [1.0], [2.0], [0.5], [1.0]),
              "prefix_affinity": bench.RunResult("prefix_affinity", [], 0, 0.0)}  # none ok
    bench.plot_ttft(pooled, str(tmp_path / "ttft.png"), "title")
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"


def test_paired_rounds_give_a_mean_and_a_t_interval_per_figure(bench, capsys):
    by_round = [{"kv": fake_summary(700.0, 30.0, 0.50, 0),
                 "prefix_affinity": fake_summary(1000.0, 30.0, 0.52, 0)},
                {"kv": fake_summary(600.0, 29.7, 0.60, 0),
                 "prefix_affinity": fake_summary(1000.0, 30.0, 0.58, 0)},
                {"kv": fake_summary(800.0, 30.3, 0.55, 0),
                 "prefix_affinity": fake_summary(1000.0, 30.0, 0.55, 0),
                 "pow2": fake_summary(1600.0, 30.0, 0.40, 0)}]
    got = bench.paired(by_round, "prefix_affinity")
    p99 = got["ttft_p99_ms"]
    # ratios 0.7, 0.6, 0.8: mean 0.7, sd 0.1, half-width t(2) 4.303 * 0.1 / sqrt(3) = 0.2484
    assert p99["kind"] == "ratio" and p99["by_round"] == [0.7, 0.6, 0.8]
    assert p99["mean"] == 0.7 and p99["ci95"] == [0.4516, 0.9484] and not p99["even"]
    assert got["throughput_tok_s"]["by_round"] == [1.0, 0.99, 1.01]
    assert got["throughput_tok_s"]["even"]  # 0.99 and 1.01 around 1: the rounds cannot tell
    hits = got["prefix_hit_rate"]
    assert hits["kind"] == "difference" and hits["by_round"] == [-0.02, 0.02, 0.0]
    assert hits["even"]
    assert got["preemptions"]["ci95"] == [0.0, 0.0] and got["preemptions"]["even"]
    # pow2 ran in one round only: nothing to pair
    assert all(fig is None for fig in bench.paired(by_round, "pow2").values())
    bench.print_paired({"prefix_affinity": got, "pow2": bench.paired(by_round, "pow2")})
    printed = capsys.readouterr().out
    assert "against prefix affinity" in printed
    assert "ttft_p99_ms ratio 0.7 [0.4516, 0.9484];" in printed
    assert "against pow2 (default) (mean, 95% t-interval): fewer than 2 rounds" in printed


def test_repeat_takes_a_count_and_one_target(bench, capsys):
    args = bench.parse_args(["--repeat", "3"])
    assert args.repeat == 3 and args.plot_out == bench.DEFAULT_ROUNDS_PLOT
    assert bench.parse_args([]).plot_out == bench.DEFAULT_PLOT
    for argv in (["--repeat", "0"], ["--repeat", "2", "--target", "0.6,0.7"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(argv)
        assert exc.value.code == 2
        assert "--repeat" in capsys.readouterr().err
