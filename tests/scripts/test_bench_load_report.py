"""scripts/bench_load_report.py: both walks timed on each queue, the bounded one reaching the
full one's figure; the JSON last line; a bad --queues refused by name."""

from __future__ import annotations

import json

from bench_scripts import run_script


def test_times_both_walks_per_queue_and_ends_with_json():
    result = run_script("bench_load_report", "--queues", "4x64,200x256", "--reports", "3",
                        timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(figures["queues"]) == {"4x64", "200x256"}
    small, long = figures["queues"]["4x64"], figures["queues"]["200x256"]
    # 4 requests of 4 blocks (and 20 more tokens each) fit one report's walk; 200 of 16 do not
    assert small["reports_to_exact"] == 1 and long["reports_to_exact"] == 2
    assert small["exact_tokens"] == 4 * 20 and long["exact_tokens"] == 200 * 20
    assert all(q[k] > 0 for q in (small, long)
               for k in ("full_ms", "bounded_first_ms", "bounded_later_ms"))


def test_a_bad_queue_is_refused_by_name():
    result = run_script("bench_load_report", "--queues", "64by2048", timeout=60)
    assert result.returncode != 0
    assert "--queues: expected NxL" in result.stderr
