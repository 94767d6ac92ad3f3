"""scripts/bench_served_vs_vllm.py without vLLM or aiperf: its argument checks, its one-line exits
when a baseline cannot be set up, the figures it reads from aiperf's export and its own client,
the prompts it builds, and how it starts and stops a server (a real HTTP server on loopback).
The comparison itself is the lead's benchmark (docs/benchmarks/vs-vllm.md)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from bench_scripts import assert_flag_refused, assert_one_line_error, load_script, run_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_served_vs_vllm")


@pytest.mark.parametrize("argv, flag", [
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--output-tokens", "0"], "--output-tokens must be at least 1"),
    (["--systems", "tpserve,sglang"], "--systems: sglang is not a system"),
    (["--client", "locust"], "--client: invalid choice: 'locust'"),
    (["--port", "70000"], "--port must be a TCP port"),
    (["--concurrency", "9", "--num-requests", "8"], "--concurrency 9 is more than"),
    (["--offline-threads", "0"], "--offline-threads must be at least 1"),
    (["--client-cpus", "one"], "--client-cpus: expected a core list"),
    (["--client-cpus", "4096"], "--client-cpus: core(s) 4096 are not among this process's"),
])
def test_bad_arguments_name_the_flag(bench, capsys, argv, flag):
    assert_flag_refused(bench, capsys, argv, flag)


def test_defaults_are_the_issue_load_and_smoke_is_small(bench):
    args = bench.parse_args([])
    assert (args.client, args.concurrency, args.num_requests, args.input_tokens,
            args.output_tokens, args.systems) == ("aiperf", 8, 48, 256, 64, ["tpserve", "vllm"])
    smoke = bench.parse_args(["--smoke", "--systems", "vllm"])
    assert (smoke.num_requests, smoke.concurrency, smoke.rounds, smoke.systems) == \
        (4, 2, 1, ["vllm"])


def test_client_cpus_auto_leaves_the_lowest_core_to_the_engines(bench):
    assert bench.client_cores("auto", [0, 1, 2, 3]) == (1, 2, 3)
    assert bench.client_cores("auto", [5]) is None  # one core: nothing to leave
    assert bench.client_cores("all", [0, 1]) is None
    assert bench.client_cores("1,3", [0, 1, 2, 3]) == (1, 3)
    assert bench.parse_args([]).client_cpus is None  # unpinned unless asked


def test_the_load_generator_starts_on_the_client_cores_and_the_bench_is_restored(bench):
    """A process started under `client_affinity` (as aiperf is) runs on the client's cores;
    the bench's own affinity is as before once the load is done."""
    import subprocess

    before = os.sched_getaffinity(0)
    core = min(before)
    with bench.client_affinity((core,)):
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str([core])
    assert os.sched_getaffinity(0) == before


def test_unwritable_vllm_venv_exits_with_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_script("bench_served_vs_vllm", "--smoke", "--vllm-venv", str(blocker / "venv"),
                      timeout=120)
    assert_one_line_error(proc, f"could not create the vLLM virtualenv {blocker / 'venv'}",
                          returncode=1)


def test_aiperf_that_pip_cannot_find_exits_with_one_line(tmp_path, monkeypatch):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    # No index and an empty wheel folder: pip fails at once, for real, finding no aiperf.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    venv = tmp_path / "venv"
    proc = run_script("bench_served_vs_vllm", "--smoke", "--systems", "tpserve",
                      "--aiperf-venv", str(venv), timeout=180)
    assert_one_line_error(proc, f"pip install aiperf==0.13.0 into {venv} failed", returncode=1)
    assert not (venv / "tpserve-aiperf-ready").exists()


def test_aiperf_export_figures_in_seconds():
    from scripts.served.aiperf import AiperfLoad, export_figures

    export = {"output_token_throughput": {"unit": "tokens/sec", "avg": 90.5},
              "time_to_first_token": {"unit": "ms", "p50": 250.0, "p99": 400.0},
              "inter_token_latency": {"unit": "ms", "p50": 80.0},
              "request_count": {"avg": 48.0}, "benchmark_duration": {"avg": 34.0}}
    figures = export_figures(export)
    assert figures["output_tok_s"] == 90.5
    assert figures["ttft_p50_s"] == pytest.approx(0.25)
    assert figures["ttft_p99_s"] == pytest.approx(0.4)
    assert figures["itl_p50_s"] == pytest.approx(0.08)
    assert figures["num_failed"] == 0.0
    command = AiperfLoad("m", Path("/tok"), 256, 64, 8, 48).command(Path("aiperf"), "http://h:1",
                                                                      Path("/out"))
    for flag, value in [("--concurrency", "8"), ("--request-count", "48"),
                        ("--prompt-input-tokens-mean", "256"), ("--url", "http://h:1")]:
        assert command[command.index(flag) + 1] == value
    assert "ignore_eos:true" in command and "--streaming" in command


def test_summary_medians_and_ratios(bench):
    def run(tok_s, ttft99):
        return {"output_tok_s": tok_s, "ttft_p50_s": 0.2, "ttft_p99_s": ttft99,
                "itl_p50_s": 0.05}

    result = bench.summary({"tpserve": [run(100, 1.0), run(120, 2.0), run(110, 3.0)],
                            "vllm": [run(50, 4.0)]})
    assert result["tpserve_output_tok_s"] == 110 and result["tpserve_ttft_p99_s"] == 2.0
    assert result["ratio_vs_vllm_output_tok_s"] == pytest.approx(2.2)
    assert result["ratio_vs_vllm_ttft_p99_s"] == pytest.approx(0.5)
    assert result["ratio_vs_offline_output_tok_s"] is None  # no offline run


def test_client_figures_time_tokens_not_chunks():
    from scripts.served.load import LoadResult, RequestResult, percentile

    # 64 tokens, the first at 0.5 s and the last at 6.8 s, whatever the chunks carried.
    result = RequestResult(ttft_s=0.5, latency_s=6.8, num_output_tokens=64, num_prompt_tokens=9,
                           num_chunks=32)
    assert result.itl_s == pytest.approx(0.1)
    figures = LoadResult([result, RequestResult(0, 0, 0, 0, "boom")], wall_s=2.0).figures()
    assert figures["output_tok_s"] == 32 and figures["num_failed"] == 1
    assert figures["tokens_per_chunk"] == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 99) is None


def test_prompts_have_the_asked_length_and_differ(smollm2_tiny):
    from transformers import AutoTokenizer

    from scripts.served.prompts import chat_token_ids, user_messages

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tiny))
    messages = user_messages(tokenizer, 3, 64, seed=1)
    lengths = [len(tokenizer.encode(m, add_special_tokens=False)) for m in messages]
    assert all(60 <= n <= 64 for n in lengths), lengths
    assert len(set(messages)) == 3 and messages == user_messages(tokenizer, 3, 64, seed=1)
    ids = chat_token_ids(tokenizer, messages)
    assert all(len(i) > n for i, n in zip(ids, lengths))  # the template's tokens around it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _static_server(tmp_path):
    """A real HTTP server on loopback that lists one model, "tiny", at /v1/models."""
    from scripts.served.servers import ServerSpec

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text('{"data": [{"id": "tiny"}]}')
    port = free_port()
    return ServerSpec("static", [sys.executable, "-m", "http.server", str(port), "--bind",
                                 "127.0.0.1", "--directory", str(tmp_path)], port,
                      tmp_path / "server.log")


def test_server_waits_for_its_models_and_stops(tmp_path):
    from scripts.served.servers import Server

    spec = _static_server(tmp_path)
    with Server(spec, ready_timeout_s=30) as server:
        assert server.model_ids == ["tiny"]
    assert server.proc.returncode is not None


def test_a_server_started_where_sigint_is_ignored_still_stops_on_it(tmp_path):
    """A bench run from a non-interactive shell's background job inherits SIGINT ignored; the
    server it starts must still take the SIGINT that stops it (not wait out the grace period
    for the SIGKILL)."""
    import signal

    from scripts.served.servers import Server

    spec = _static_server(tmp_path)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = Server(spec, ready_timeout_s=30)
    finally:
        signal.signal(signal.SIGINT, before)
    server.stop(grace_s=20)
    assert server.proc.returncode != -signal.SIGKILL  # it left on the SIGINT


def test_server_that_exits_names_its_log(tmp_path):
    from scripts.served.servers import Server, ServerError, ServerSpec

    spec = ServerSpec("broken", [sys.executable, "-c", "raise SystemExit('error: no model')"],
                      free_port(), tmp_path / "broken.log")
    with pytest.raises(ServerError, match="broken exited .*error: no model.*broken.log"):
        Server(spec, ready_timeout_s=30)
