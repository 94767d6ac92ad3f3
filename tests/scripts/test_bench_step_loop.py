"""scripts/bench_step_loop.py: the serial and overlapped loops on a tiny checkpoint (both must
give the same ids, else it exits 1), and its argument checks."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_script, run_script


@pytest.mark.slow
def test_both_loops_run_and_agree(tmp_path, tiny_llama):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:17:00.0,80,6\n2023-11-16 18:17:01.0,160,3\n")
    proc = run_script("bench_step_loop", "--model", str(tiny_llama), "--trace", str(trace),
                      "--num-requests", "2", "--decode-requests", "3", "--max-output", "5",
                      "--dtype", "float32", "--rounds", "1", "--skip-hf")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same_ids"] is True and result["rounds"] == 1
    for key in ("prefill", "decode"):
        assert result[f"ratio_overlapped_vs_serial_{key}"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--rounds", "x"], "--rounds needs an integer"),
    (["--structured"], "--structured is bench_engine.py's own benchmark"),
])
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        load_script("bench_step_loop").parse_args(argv)
