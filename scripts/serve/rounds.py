"""Repeated rounds of the serving benchmark (``bench_serve.py --repeat N``) and their pooled
figures.

One 200-request replay cannot tell a router's lead from this host's noise: its TTFT p99 is its
second-slowest request, and its prefix hit rate moves with whichever conversation histories the
pools happen to evict. With ``--repeat N`` every router replays the same requests N times:

* round i offers Poisson arrivals seeded ``--seed + i`` at the same rate (round 0's are the
  single run's), so the rounds sample the arrival process, not one draw of it;
* round i runs the routers in the order of ``--routers`` rotated by i, so none always runs first
  (or last) on a host whose load drifts.

The headline figures and the targets are then the pooled ones: every request of every round in
one latency distribution, throughput as all output tokens over the rounds' summed windows, the
hit rate as all hits over all prompt tokens looked up, preemptions summed. Each round's own
figures and how many rounds met each target are printed beside them, and a PNG shows each
router's pooled TTFT distribution. Since a round's routers serve the same arrivals, each round
is a pair: the KV-aware router's figure over (or less) another's, round by round, with the mean
and a 95% t-interval (`paired`), says whether the rounds tell two routers apart at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from scripts.serve.replay import RunResult, add_counts
from scripts.serve.report import ROUTER_LABELS, json_suffix

ROUND_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "throughput_tok_s",
              "prefix_hit_rate", "preemptions", "num_failed", "prefill_tokens_by_group")


def round_orders(routers: Sequence[str], rounds: int) -> List[List[str]]:
    """The routers' order in each round: ``routers`` rotated by the round's index."""
    n = len(routers)
    return [list(routers[i % n:]) + list(routers[:i % n]) for i in range(rounds)]


def pool_runs(runs: Sequence[RunResult]) -> RunResult:
    """One run that holds every round of a router, for `serve_report.summarize`: each round's
    request times shifted to start where the round before it ended (so the window is the sum of
    the rounds' windows), the groups' counters and KV usage merged by the group's place in its
    round (lowest peak usage first: deployments name their groups afresh), the router's
    decision times and reasons concatenated and added, the other processes' CPU share the
    highest of any round's."""
    if not runs:
        raise ValueError("pool_runs needs at least one run")
    pooled = RunResult(runs[0].router, [], 0, start=0.0)
    clock = 0.0
    for run in runs:
        offset = clock - run.start
        for r in run.results:
            pooled.results.append(dataclasses.replace(
                r, sent_at=None if r.sent_at is None else r.sent_at + offset,
                ended_at=None if r.ended_at is None else r.ended_at + offset))
        ends = [r.ended_at for r in run.results
                if r.sent_at is not None and r.ended_at is not None]
        clock += (max(ends) - run.start) if ends else 0.0
        pooled.num_not_sent += run.num_not_sent
        _merge_groups(pooled, run)
        pooled.router_stats = _merge_router_stats(pooled.router_stats, run.router_stats)
    fracs = [run.other_cpu_frac for run in runs if run.other_cpu_frac is not None]
    pooled.other_cpu_frac = round(max(fracs), 3) if fracs else None
    pooled.load_avg = [runs[0].load_avg[0] if runs[0].load_avg else None,
                       runs[-1].load_avg[-1] if runs[-1].load_avg else None]
    return pooled


def _merge_groups(pooled: RunResult, run: RunResult) -> None:
    groups = sorted(set(run.kv_usage_peak) | set(run.group_counters),
                    key=lambda g: (run.kv_usage_peak.get(g, 0.0), g))
    for place, group in enumerate(groups):
        key = f"group {place}"
        if group in run.kv_usage_peak:
            pooled.kv_usage_peak[key] = max(pooled.kv_usage_peak.get(key, 0.0),
                                            run.kv_usage_peak[group])
            pooled.kv_usage_sum[key] = (pooled.kv_usage_sum.get(key, 0.0)
                                        + run.kv_usage_sum[group])
            pooled.kv_usage_samples[key] = (pooled.kv_usage_samples.get(key, 0)
                                            + run.kv_usage_samples[group])
        merged = pooled.group_counters.setdefault(key, {})
        for name, value in run.group_counters.get(group, {}).items():
            merged[name] = merged.get(name, 0.0) + value


def _merge_router_stats(a: Optional[Dict[str, Any]],
                        b: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if b is None:
        return a
    if a is None:
        return {**b, "times_us": list(b["times_us"]), "counts": dict(b["counts"]),
                "given_up": dict(b.get("given_up", {}))}
    return {**a, "times_us": a["times_us"] + b["times_us"],
            "counts": add_counts(dict(a["counts"]), b["counts"]),
            "given_up": add_counts(dict(a.get("given_up", {})), b.get("given_up", {}))}


def rounds_json(by_round: Sequence[Dict[str, Dict[str, Any]]],
                checks_by_round: Sequence[Dict[str, Optional[bool]]]) -> Dict[str, Any]:
    """Each router's round figures as lists, ``<figure>_by_round<suffix>``, and per target
    check the number of rounds that met it, ``<check>_rounds`` (None where no round could be
    checked: a router or a figure missing)."""
    out: Dict[str, Any] = {"rounds": len(by_round)}
    for router in by_round[0]:
        for key in ROUND_KEYS:
            out[f"{key}_by_round{json_suffix(router)}"] = [s[router].get(key) for s in by_round]
    for check in checks_by_round[0]:
        verdicts = [c[check] for c in checks_by_round if c[check] is not None]
        out[f"{check}_rounds"] = sum(verdicts) if verdicts else None
    return out


def print_rounds(orders: Sequence[Sequence[str]], by_round: Sequence[Dict[str, Dict[str, Any]]],
                 checks_by_round: Sequence[Dict[str, Optional[bool]]],
                 counts: Dict[str, Any]) -> None:
    """A line per round, numbered from 1 as the run's log does (its order, TTFT p99,
    throughput, hit rate of each router, the checks missed), then per check the rounds that met
    it (``counts``: `rounds_json` of the same rounds)."""
    print(f"\n{len(by_round)} rounds (the table above pools them); per round, in --routers "
          f"order: TTFT p99 ms | throughput tok/s | hit rate | preemptions")
    for i, (order, summary) in enumerate(zip(orders, by_round)):
        cells = [" / ".join(_cell(summary[r].get(key)) for r in summary) for key in
                 ("ttft_p99_ms", "throughput_tok_s", "prefix_hit_rate", "preemptions")]
        missed = [k for k, v in checks_by_round[i].items() if v is False]
        print(f"  round {i + 1} (ran {', '.join(order)}): {' | '.join(cells)}; missed: "
              f"{', '.join(missed) or 'none'}")
    print("rounds meeting each target: " + ", ".join(
        f"{check} {counts[check + '_rounds']}/{len(by_round)}" for check in checks_by_round[0]
        if counts[check + "_rounds"] is not None))


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# The target figures compared round by round: as a ratio (ours / theirs) or a difference.
PAIRED = (("ttft_p99_ms", "ratio"), ("throughput_tok_s", "ratio"),
          ("prefix_hit_rate", "difference"), ("preemptions", "difference"))


def paired(by_round: Sequence[Dict[str, Dict[str, Any]]], other: str,
           ours: str = "kv") -> Dict[str, Optional[Dict[str, Any]]]:
    """``ours`` against ``other`` round by round (the same arrivals, so each round is a pair):
    per figure of `PAIRED` the per-round values, their mean and its 95% t-interval over the
    rounds, and ``even`` (the interval holds 1 for a ratio, 0 for a difference: the rounds do
    not tell the routers apart on it). None for a figure fewer than two rounds have."""
    out: Dict[str, Optional[Dict[str, Any]]] = {}
    for key, kind in PAIRED:
        values = []
        for summary in by_round:
            a, b = summary.get(ours, {}).get(key), summary.get(other, {}).get(key)
            if a is None or b is None or (kind == "ratio" and not b):
                continue
            values.append(a / b if kind == "ratio" else a - b)
        if len(values) < 2:
            out[key] = None
            continue
        n = len(values)
        mean = sum(values) / n
        sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
        half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / n ** 0.5
        even = 1.0 if kind == "ratio" else 0.0
        out[key] = {"kind": kind, "by_round": [round(v, 4) for v in values],
                    "mean": round(mean, 4), "ci95": [round(mean - half, 4), round(mean + half, 4)],
                    "even": mean - half <= even <= mean + half}
    return out


def print_paired(comparisons: Dict[str, Dict[str, Optional[Dict[str, Any]]]]) -> None:
    """A line per compared router: each figure's mean and 95% interval, round by round."""
    for other, figures in comparisons.items():
        cells = []
        for key, fig in figures.items():
            if fig is not None:
                cells.append(f"{key} {fig['kind']} {fig['mean']:g} [{fig['ci95'][0]:g}, "
                             f"{fig['ci95'][1]:g}]{' (even)' if fig['even'] else ''}")
        print(f"paired by round, {ROUTER_LABELS['kv']} against {ROUTER_LABELS[other]} (mean, "
              f"95% t-interval): " + ("; ".join(cells) or "fewer than 2 rounds"))


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def plot_ttft(pooled: Dict[str, RunResult], path: str, title: str) -> None:
    """Each router's pooled TTFT distribution (every round's requests) as a CDF, log time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for router, run in pooled.items():
        ttft = numpy.sort([r.ttft_s * 1000 for r in run.results if r.is_ok])
        if len(ttft):
            ax.step(ttft, numpy.arange(1, len(ttft) + 1) / len(ttft), where="post",
                    label=f"{ROUTER_LABELS[router]} (p99 {numpy.percentile(ttft, 99):,.0f} ms)")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
