"""The serving benchmark's figures: a run's summary, the per-router table, the targets, the flat
JSON line, and the occupancy-target sweep's table and plot."""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from scripts.serve.replay import RunResult

ROUTER_LABELS = {"kv": "kv-aware", "pow2": "pow2 (default)",
                 "prefix_affinity": "prefix affinity", "round_robin": "round robin"}
TTFT_P99_TARGET_RATIO = 0.8  # TTFT p99 at least 20% below power of two


def json_suffix(router: str) -> str:
    """The KV-aware router's figures carry no suffix; the others ``_<router>``."""
    return "" if router == "kv" else f"_{router}"


def run_label(router: str, target: Optional[float] = None) -> str:
    """A run's name in logs and tables: its router, and its target in a sweep."""
    return ROUTER_LABELS[router] + ("" if target is None else f" @{target:g}")


# ----- statistics -----


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    if not values:
        return None
    import numpy

    return float(numpy.percentile(values, q))


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value * 1000, 1)


def summarize(run: RunResult) -> Dict[str, Any]:
    ok = [r for r in run.results if r.is_ok]
    sent = [r for r in run.results if r.sent_at is not None]
    failures: Dict[str, int] = {}
    for r in sent:
        if not r.is_ok:
            failures[r.error] = failures.get(r.error, 0) + 1
    ends = [r.ended_at for r in sent if r.ended_at is not None]
    window = (max(ends) - run.start) if ends else 0.0
    out_tokens = sum(r.num_output_tokens or r.num_streamed_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    return {
        "num_sent": len(sent), "num_ok": len(ok), "num_failed": len(sent) - len(ok),
        "num_not_sent": run.num_not_sent, "failures": failures,
        "duration_s": round(window, 2), "output_tokens": out_tokens,
        "throughput_tok_s": round(out_tokens / window, 2) if window else 0.0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)), "e2e_p99_ms": _ms(percentile(e2e, 99)),
        **group_figures(run),
        "other_cpu_frac": run.other_cpu_frac, "load_avg": run.load_avg,
    }


def group_figures(run: RunResult) -> Dict[str, Any]:
    """KV usage (peak and mean per group), preemptions and prefix hits from the groups' metrics.
    Groups are listed in the order of their peak usage, lowest first."""
    def total(name: str) -> float:
        return sum(c.get(name, 0.0) for c in run.group_counters.values())

    groups = sorted(run.kv_usage_peak, key=run.kv_usage_peak.__getitem__)
    means = [run.kv_usage_sum[g] / run.kv_usage_samples[g] for g in groups]
    queries = total("prefix_cache_queries")  # prompt tokens looked up: each prefill, per group
    return {
        "kv_usage_peak": round(max(run.kv_usage_peak.values(), default=0.0), 3),
        "kv_usage_peak_by_group": [round(run.kv_usage_peak[g], 3) for g in groups],
        "kv_usage_mean_by_group": [round(m, 3) for m in means],
        "prefill_tokens_by_group": sorted(int(c.get("prefix_cache_queries", 0))
                                          for c in run.group_counters.values()),
        "preemptions": int(total("num_preemptions")),
        "prefix_hit_rate": round(total("prefix_cache_hits") / queries, 3) if queries else None,
    }


def time_rank_groups(num_groups: int, num_calls: int = 2000, seed: int = 0) -> float:
    """p50 microseconds of `cluster.routing.ranking.rank_groups` over realistic synthetic loads: pools
    of 512 blocks 10-90% used, 2048 cached hashes per group, a 16-block request whose prefix a
    few groups hold, found as the router finds it (one `PrefixIndex` walk, timed too)."""
    from cluster.routing.ranking import GroupLoad, RequestDemand, rank_groups
    from cluster.routing.prefix_index import PrefixIndex

    rng = random.Random(seed)
    demand = RequestDemand(256, tuple(rng.getrandbits(63) for _ in range(16)), 16)
    loads = []
    for g in range(num_groups):
        cached = {rng.getrandbits(63) for _ in range(2048)}
        if g % 8 == 0:
            cached.update(demand.block_hashes[:rng.randrange(1, 16)])
        loads.append(GroupLoad(f"group-{g}", rng.randrange(51, 461), 512, 16, rng.randrange(512),
                               frozenset(cached), 1, rng.random(), rng.randrange(256)))
    index = PrefixIndex()
    for group_load in loads:
        index.add(index.add_group(group_load.group_id), group_load.cached_block_hashes)

    def rank() -> None:
        rank_groups(demand, loads, cached_prefix=index.prefix_blocks(demand.block_hashes))

    for _ in range(num_calls // 10):  # warm caches before timing
        rank()
    times = []
    for _ in range(num_calls):
        begin = time.perf_counter_ns()
        rank()
        times.append((time.perf_counter_ns() - begin) / 1000)
    return round(percentile(times, 50), 2)


# ----- targets -----


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def target_checks(summary: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[bool]]:
    """The KV-aware router against power of two (TTFT p99 at least 20% lower, throughput not
    lower, a higher prefix hit rate, fewer preemptions) and against prefix affinity (no worse
    on any of the four). None: a router or a figure is missing."""
    kv = summary.get("kv")
    checks: Dict[str, Optional[bool]] = {}
    for other, ttft_ratio in (("pow2", TTFT_P99_TARGET_RATIO), ("prefix_affinity", 1.0)):
        s = summary.get(other)
        suffix = json_suffix(other)
        checks["ttft_p99_met" + suffix] = _holds(kv, s, "ttft_p99_ms",
                                                 lambda a, b: a <= ttft_ratio * b)
        checks["throughput_met" + suffix] = _holds(kv, s, "throughput_tok_s",
                                                   lambda a, b: a >= b)
        checks["prefix_hit_rate_met" + suffix] = _holds(
            kv, s, "prefix_hit_rate", (lambda a, b: a > b) if other == "pow2"
            else (lambda a, b: a >= b))
        checks["preemptions_met" + suffix] = _holds(
            kv, s, "preemptions", (lambda a, b: a < b or a == b == 0) if other == "pow2"
            else (lambda a, b: a <= b))
    return checks


def _holds(kv: Optional[Dict], other: Optional[Dict], key: str, test) -> Optional[bool]:
    if kv is None or other is None or kv.get(key) is None or other.get(key) is None:
        return None
    return bool(test(kv[key], other[key]))


# ----- printing -----


ROWS = [("requests ok / failed / not sent", "num_ok", "num_failed", "num_not_sent"),
        ("throughput (output tok/s)", "throughput_tok_s"),
        ("duration (s)", "duration_s"),
        ("TTFT p50 / p99 (ms)", "ttft_p50_ms", "ttft_p99_ms"),
        ("ITL p50 / p99 (ms)", "itl_p50_ms", "itl_p99_ms"),
        ("e2e p50 / p99 (ms)", "e2e_p50_ms", "e2e_p99_ms"),
        ("KV usage peak by group", "kv_usage_peak_by_group"),
        ("KV usage mean by group", "kv_usage_mean_by_group"),
        ("prefill tokens by group", "prefill_tokens_by_group"),
        ("preemptions", "preemptions"),
        ("prefix-cache hit rate", "prefix_hit_rate"),
        ("load average (1 min) start / end", "load_avg"),
        ("CPU used by other processes", "other_cpu_frac")]


def print_table(columns: Dict[str, Dict[str, Any]]) -> None:
    """One column per run (its label -> its summary), one row per figure."""
    print(f"{'':34}" + "".join(f"{label:>22}" for label in columns))
    for label, *keys in ROWS:
        cells = [" / ".join(_cell(s.get(k)) for k in keys) for s in columns.values()]
        print(f"{label:34}" + "".join(f"{cell:>22}" for cell in cells))
    for label, s in columns.items():
        if s["failures"]:
            print(f"failed requests ({label}) by kind: {s['failures']}")


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return " / ".join(str(v) for v in value)
    return "-" if value is None else str(value)


def print_header(meta: Dict[str, Any]) -> None:
    print(f"\ntrace {meta['trace']} ({meta['trace_format']}): {meta['num_requests']} requests "
          f"in {meta['num_conversations']} whole conversations (seed {meta['seed']}), "
          f"{meta['system_prompt_blocks']} shared system-prompt blocks; {meta['arrival_desc']}")
    if meta.get("sustained_req_s") is not None:
        print(f"--rate auto: the groups sustained {meta['sustained_req_s']} req/s "
              f"({meta['calibration_requests']} requests all at once, pow2, "
              f"{meta['calibration_s']} s); Poisson rate = {meta['load']} x that = "
              f"{meta['rate_req_s']} req/s")
    print(f"scaling: prompts / {meta['prompt_scale']}, outputs capped at {meta['max_output']}; "
          f"{meta['workload_prompt_tokens']} prompt and {meta['workload_output_tokens']} output "
          f"tokens in all")
    print(f"model {meta['model']} ({meta['dtype']}), {meta['groups']} groups x TP {meta['tp']}, "
          f"KV pool {meta['kv_blocks']} blocks x {meta['block_size']} tokens per group "
          f"({meta['kv_blocks_why']}{host_tier(meta)}); working set "
          f"{meta['working_set_blocks']} blocks = "
          f"{meta['working_set_over_pool']} x one group's pool; prefix hit rate at best "
          f"{meta['ideal_prefix_hit_rate']} (one endless pool, one request at a time)\n")


def host_tier(meta: Dict[str, Any]) -> str:
    blocks = meta.get("host_kv_blocks")
    return f", and a host tier of {blocks} blocks" if blocks else ""


def print_router_lines(meta: Dict[str, Any], checks: Dict[str, Optional[bool]]) -> None:
    r = meta["router"]
    print(f"\nrouter decision time: p50 {r['router_decision_us_p50']} us, p99 "
          f"{r['router_decision_us_p99']} us over {r['num_router_decisions']} live decisions "
          f"({r['router_decision_source']}); reasons {r['router_decisions_by_reason']}; "
          f"away from a longer cached prefix {r.get('router_prefix_given_up', {})}")
    print(f"rank_groups and the prefix-index walk alone (this process, hot): p50 "
          f"{r['rank_groups_us_p50_2_groups']} us with 2 "
          f"groups, {r['rank_groups_us_p50_64_groups']} us with 64 (the router ranks uniform "
          f"fleets by its C call where it is loaded; the 50 us target is for live decisions; "
          f"scripts/bench_router.py times whole decisions, cold too)")
    if checks:
        print("targets (kv-aware vs pow2: TTFT p99 <= 0.8x, throughput >=, hit rate >, fewer "
              "preemptions; vs prefix affinity: no worse): "
              + ", ".join(f"{k} {'-' if v is None else ('yes' if v else 'NO')}"
                          for k, v in checks.items()))


def router_figures(kv_stats: Optional[Dict[str, Any]],
                   rank_us: Dict[int, float]) -> Dict[str, Any]:
    """The KV-aware router's live decision times (its ingress stats), else the policy timed
    here (``rank_us``: microseconds per group count)."""
    kv_stats = kv_stats or {"times_us": [], "counts": {}}
    times = kv_stats["times_us"]
    return {
        "router_decision_us_p50": round(percentile(times, 50), 2) if times else rank_us[2],
        "router_decision_us_p99": round(percentile(times, 99), 2) if times else None,
        "router_decision_source": "live KVAwareRouter.choose_replicas in the ingress replica"
        if times else "rank_groups in this process, 2 groups (no live decisions recorded)",
        "num_router_decisions": len(times),
        "router_decisions_by_reason": kv_stats["counts"],
        # decisions (by reason) to a group holding fewer of the request's blocks than another,
        # and the blocks given up (<reason>_blocks)
        "router_prefix_given_up": kv_stats.get("given_up", {}),
        "rank_groups_us_p50_2_groups": rank_us[2],
        "rank_groups_us_p50_64_groups": rank_us[64],
    }


def flat_json(summary: Dict[str, Dict[str, Any]], meta: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for router, figures in summary.items():
        for key, value in figures.items():
            out[key + json_suffix(router)] = value
    out.update(meta["router"])
    out.update({k: v for k, v in meta.items() if k != "router"})
    return out


# ----- the occupancy-target sweep -----


SWEEP_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "throughput_tok_s", "prefix_hit_rate",
              "preemptions", "kv_usage_peak", "num_failed", "load_avg")


def sweep_json(targets: Sequence[float], summaries: List[Dict[str, Any]],
               suffix: str = "") -> Dict[str, Any]:
    """One router's figures as lists over the targets: ``<figure>_by_target<suffix>``."""
    out: Dict[str, Any] = {"sweep_targets": list(targets)}
    for key in SWEEP_KEYS:
        out[f"{key}_by_target{suffix}"] = [s[key] for s in summaries]
    return out


def finish_sweep(targets: Sequence[float], routers: Sequence[str],
                 summary: Dict[Tuple[str, Optional[float]], Dict[str, Any]],
                 meta: Dict[str, Any], plot_out: str) -> Dict[str, Any]:
    """The swept routers' figures by target, and the plot (the other routers: flat lines).
    ``summary`` is keyed by (router, target), target None for a router run once."""
    swept = {router: [summary[(router, t)] for t in targets]
             for router in routers if (router, targets[0]) in summary}
    baselines = {router: s for (router, target), s in summary.items() if target is None}
    title = (f"{meta['num_requests']} requests, {meta['arrival_desc']}, "
             f"{meta['groups']} groups x {meta['kv_blocks']} blocks")
    plot_sweep(targets, swept, baselines, plot_out, title)
    print(f"plot: {plot_out}")
    out: Dict[str, Any] = {"plot": plot_out}
    for router, summaries in swept.items():
        out.update(sweep_json(targets, summaries, json_suffix(router)))
    return out


def plot_sweep(targets: Sequence[float], swept: Dict[str, List[Dict[str, Any]]],
               baselines: Dict[str, Dict[str, Any]], path: str, title: str) -> None:
    """TTFT p99 (top) and throughput (bottom) against the occupancy target, one PNG: a line per
    swept router, a flat dashed line per router run once (the baselines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(6.4, 6.4))
    panels = tuple(zip(axes, ("ttft_p99_ms", "throughput_tok_s"),
                       ("TTFT p99 (ms)", "throughput (output tok/s)")))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2)
    for router, summaries in swept.items():
        color = next(colors)
        for ax, key, _ in panels:
            ax.plot(targets, [_nan(s[key]) for s in summaries], "o-", color=color,
                    label=ROUTER_LABELS[router])
    for router, summary in baselines.items():
        color = next(colors)
        for ax, key, _ in panels:
            ax.axhline(_nan(summary[key]), color=color, linestyle="--",
                       label=ROUTER_LABELS[router])
    for ax, _, ylabel in panels:
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # from zero: a flat line must look flat
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title(title, fontsize=9)
    axes[1].set_xlabel("KV occupancy target")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _nan(value: Optional[float]) -> float:
    return float("nan") if value is None else value
