"""scripts/bench_kv_tiers.py: end to end in --quick mode on a tiny checkpoint, its errors on bad
trace files, and its context fitting. The trace reader, the prefix-root subset, the ideal hit rate
and the token blocks are tested in test_traces.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_scripts import load_script, run_script, script_path

SCRIPT = script_path("bench_kv_tiers")

CONFIGS = ("device_only", "lru", "lru_write_back", "hotness_selective")
REQUIRED_KEYS = (
    "host_copy_ratio", "disk_ratio", "hit_rate_device_only", "hit_rate_lru",
    "hit_rate_lru_write_back", "ttft_ms_device_only", "ttft_ms_lru", "ttft_p99_ms_lru_write_back",
    "spilled_per_restored_lru", "disk_written_per_hit_lru", "configs_meeting_targets",
    "replay_targets", "targets_met",
)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_kv_tiers")


def run_bench(*args: str, timeout: int = 300):
    return run_script("bench_kv_tiers", *args, timeout=timeout)


def write_trace(path: Path, hash_lists, output_length: int = 5) -> Path:
    lines = [json.dumps({"timestamp": 100 * i, "input_length": 512 * len(h),
                         "output_length": output_length, "hash_ids": h})
             for i, h in enumerate(hash_lists)]
    path.write_text("\n".join(lines) + "\n")
    return path


def reuse_trace():
    """8 documents of 4 blocks, each asked 3 times in turn with 2 fresh blocks per request: the
    reuse distance (8 requests, 48 blocks) is beyond the quick run's device pool (14 blocks)."""
    fresh = iter(range(1000, 2000))
    return [[10 * doc + k for k in range(4)] + [next(fresh), next(fresh)]
            for _ in range(3) for doc in range(8)]


@pytest.mark.slow
def test_quick_run_prints_sane_json_last(tmp_path, tiny_llama):
    trace = write_trace(tmp_path / "trace.jsonl", reuse_trace())
    disk_dir = tmp_path / "disk"
    plot = tmp_path / "ttft.png"
    proc = run_bench("--quick", "--model", str(tiny_llama), "--trace", str(trace),
                     "--disk-dir", str(disk_dir), "--configs", ",".join(CONFIGS),
                     "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(REQUIRED_KEYS) <= set(result)
    assert result["host_copy_ratio"] > 0 and result["disk_ratio"] > 0
    for name in CONFIGS:
        assert 0 <= result[f"hit_rate_{name}"] <= 1
        assert result[f"ttft_ms_{name}"] > 0
    assert result["hit_rate_lru"] >= result["hit_rate_device_only"]
    assert result["hit_rate_lru"] > 0 and result["num_requests"] == 24
    assert result["hit_rate_lru_write_back"] > result["hit_rate_device_only"]
    for name in CONFIGS[1:]:
        assert result[f"{name}_checksum_failures_total"] == 0
    assert result["spilled_per_restored_lru"] > 0
    assert plot.stat().st_size > 0 and result["plot"] == str(plot)
    assert list(disk_dir.iterdir()) == []  # the run's own subdirectory is removed
    assert "scaled" in proc.stdout and "calibration" in proc.stdout
    # --rate auto (the default): device-only's closed-loop rate, then Poisson at 0.8 of it
    assert result["sustained_req_s_device_only"] > 0 and result["load"] == 0.8
    assert result["arrival_rate_req_s"] == pytest.approx(0.8 * result["sustained_req_s_device_only"])


@pytest.mark.slow
def test_load_sweep_reports_every_config_at_every_load(tmp_path, tiny_llama):
    trace = write_trace(tmp_path / "trace.jsonl", reuse_trace())
    plot = tmp_path / "ttft.png"
    proc = run_bench("--quick", "--parts", "c", "--model", str(tiny_llama), "--trace", str(trace),
                     "--configs", "device_only,lru", "--load", "0.5,1.5", "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = result["load_sweep"]
    assert [(r["load"], r["config"]) for r in rows] == [
        (0.5, "device_only"), (0.5, "lru"), (1.5, "device_only"), (1.5, "lru")]
    sustained = result["sustained_req_s_device_only"]
    assert all(r["rate_req_s"] == pytest.approx(r["load"] * sustained) for r in rows)
    for base, lru in (rows[0:2], rows[2:4]):  # each round against its own device-only replay
        assert lru["ttft_vs_device_only"] == pytest.approx(lru["ttft_ms"] / base["ttft_ms"])
    # every round starts cold: no disk tier left by the round before (its index would load)
    assert all(r["hit_rate"] <= result["ideal_hit_rate"] + 1e-9 for r in rows)
    assert result["load"] == 0.5 and result["ttft_ms_lru"] == rows[1]["ttft_ms"]
    assert Path(result["load_sweep_plot"]).stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--rate", "fast"], "--rate must be auto, closed or requests per second"),
    (["--rate", "-1"], "--rate must be positive"),
    (["--rate", "closed", "--load", "0.5"], "--load applies to --rate auto only"),
    (["--rate", "2.5", "--load", "0.5"], "--load applies to --rate auto only"),
    (["--load", "0.5,x"], "--load must be comma-separated fractions"),
    (["--load", "0.5,0.5"], "--load must be distinct positive fractions"),
])
def test_bad_rate_and_load_flags_are_refused_by_name(bench, capsys, flags, message):
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", *flags])
    assert message in capsys.readouterr().err


def test_rate_flags_parse(bench):
    assert bench.parse_args(["--quick"]).rate == "auto"
    assert bench.parse_args(["--quick"]).load == [0.8]
    assert bench.parse_args(["--quick", "--load", "0.5,0.9"]).load == [0.5, 0.9]
    assert bench.parse_args(["--quick", "--rate", "2.5"]).rate == 2.5
    assert bench.parse_args(["--quick", "--rate", "closed"]).rate == "closed"


def test_malformed_trace_exits_nonzero_naming_the_file(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    proc = run_bench("--quick", "--trace", str(trace), timeout=120)
    assert proc.returncode == 2
    assert str(trace) in proc.stderr and "Traceback" not in proc.stderr


def test_fit_context_caps_outputs_and_cuts_prompts(bench):
    rows = [bench.TraceRequest(0.0, 10240, 50, tuple(range(20))),
            bench.TraceRequest(1.0, 1024, 1, (1, 2))]
    fitted = bench.fit_context(rows, max_output=4, block_size=16, max_model_len=100)
    assert fitted == [bench.TraceRequest(0.0, 10240, 4, tuple(range(6))), rows[1]]


def test_requests_flag_samples_whole_conversations_under_a_shared_root(bench):
    # Every request starts with block 0 (a shared system prompt): 4 conversations of 2 turns.
    rows = [bench.TraceRequest(float(i), 512 * len(h) - 100, 1, h) for i, h in enumerate(
        [(0, 10 * c, 10 * c + 1) + (10 * c + 2,) * turn for turn in range(2) for c in range(4)])]
    args = bench.parse_args(["--quick", "--requests", "4"])
    subset = bench.sample_rows(rows, args)
    assert len(subset) == 4
    assert {r.hash_ids[1] for r in subset} == {r.hash_ids[1] for r in subset[:2]}  # 2 whole
    assert len(bench.sample_rows(rows, bench.parse_args(["--quick"]))) == 8


def test_bad_configs_are_refused_by_name():
    proc = run_bench("--quick", "--configs", "device_only,lru_write_around", timeout=120)
    assert proc.returncode == 2 and "lru_write_around" in proc.stderr


def test_hot_prompts_reuses_prompts_and_never_documents(bench):
    rows = bench.hot_prompts(200, num_prompts=8, prompt_blocks=4, doc_blocks=6, seed=1)
    assert len(rows) == 200 and all(len(r.hash_ids) == 10 for r in rows)
    prompts = [r.hash_ids[:4] for r in rows]
    documents = [b for r in rows for b in r.hash_ids[4:]]
    assert len(set(documents)) == len(documents)  # one-off documents
    assert len(set(prompts)) <= 8
    counts = sorted((prompts.count(p) for p in set(prompts)), reverse=True)
    assert counts[0] > 2 * counts[-1]  # Zipf: the first prompt is the most used
    plain, _ = bench.ideal_hit_rate(rows)
    assert abs(plain - (200 * 4 - len(set(prompts)) * 4) / (200 * 10)) < 1e-9


def test_parts_a_b_measure_bandwidth_without_a_trace(tmp_path, tiny_llama):
    disk_dir = tmp_path / "disk"
    proc = run_bench("--quick", "--parts", "a,b", "--model", str(tiny_llama),
                     "--trace", str(tmp_path / "absent.jsonl"), "--disk-dir", str(disk_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["host_copy_ratio"] > 0 and result["disk_ratio"] > 0
    assert set(result["targets_met"]) == {"host_copy_ratio_ge_0.8", "disk_ratio_ge_0.8"}
    assert "hit_rate_lru" not in result and "(c)" not in proc.stdout
    assert list(disk_dir.iterdir()) == []


def test_parts_flag_rejects_unknown_parts(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "a,d"])
    assert bench.parse_args(["--parts", "b"]).parts == {"b"}


def test_no_reuse_shares_no_block(bench):
    rows = bench.no_reuse(20, num_blocks=5)
    blocks = [b for r in rows for b in r.hash_ids]
    assert len(rows) == 20 and len(blocks) == 100 and len(set(blocks)) == 100
    assert bench.ideal_hit_rate(rows) == (0.0, 0.0)
