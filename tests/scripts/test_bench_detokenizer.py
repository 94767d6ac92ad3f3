"""scripts/bench_detokenizer.py: both detokenizers timed per workload and length, the bounded
window short where the old one grew; the JSON last line; bad arguments refused by name."""

from __future__ import annotations

import json

import pytest

from bench_scripts import run_script


def test_times_both_detokenizers_per_length_and_ends_with_json():
    result = run_script("bench_detokenizer", "--lengths", "20,60", timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])["workloads"]
    assert set(figures) == {"text", "special", "bytes"}
    assert all(set(per_length) == {"20", "60"} for per_length in figures.values())
    for workload in ("special", "bytes"):  # the old window took in every such token
        assert figures[workload]["60"]["old_window"] > 50
        assert figures[workload]["60"]["new_window"] <= 16
    assert all(f["old_us"] > 0 and f["new_us"] > 0 and f["ratio"] > 0
               for per_length in figures.values() for f in per_length.values())


@pytest.mark.parametrize("args, message", [
    (("--lengths", "100,lots"), "--lengths: expected output lengths"),
    (("--lengths", "10"), "--lengths: expected output lengths of at least 20"),
    (("--workloads", "text,emoji"), "--workloads: unknown emoji"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    result = run_script("bench_detokenizer", *args, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr
