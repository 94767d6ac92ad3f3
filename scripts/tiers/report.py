"""Reporting of ``bench_kv_tiers.py``'s replays (part c): the table, the JSON figures, the
issue's targets per config, and the plots (TTFT per config; TTFT against offered load)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from scripts.tiers.bandwidth import TARGET_COPY_RATIO, TARGET_DISK_RATIO
from scripts.tiers.replay import ReplayResult

TARGET_HIT_OF_IDEAL = 0.95
TARGET_TTFT_GAIN = 0.20
DEFAULT_TIER_CONFIG = "lru"  # the engine's defaults: LRU, write-through
# One replay round of a load sweep: (load, arrival rate req/s, one result per config).
SweepRound = Tuple[Optional[float], Optional[float], List[ReplayResult]]


def traffic(r: ReplayResult) -> Dict[str, Optional[float]]:
    """Bytes spilled per byte restored, and disk bytes written per block hit on disk."""
    s = r.tier_stats
    if "kv_tier_spilled_bytes_total" not in s:
        return {"spilled_per_restored": None, "disk_written_per_hit": None}
    restored = s["kv_tier_restored_bytes_total"]
    disk_hits = s.get("kv_tier_disk_hits_total", 0)
    return {"spilled_per_restored": s["kv_tier_spilled_bytes_total"] / restored
            if restored else None,
            "disk_written_per_hit": s.get("kv_tier_disk_written_bytes_total", 0) / disk_hits
            if disk_hits else None}


def print_replay(results: Sequence[ReplayResult], ideal: float) -> None:
    print(f"\n  {'config':<20}{'hit rate':>9}{'TTFT ms mean':>14}{'p50':>8}{'p99':>8}"
          f"{'wall s':>8}{'spill/restore':>14}{'disk B/hit':>12}{'load':>6}")
    for r in results:
        t = traffic(r)
        ratio = "-" if t["spilled_per_restored"] is None else f"{t['spilled_per_restored']:.2f}"
        per_hit = ("-" if t["disk_written_per_hit"] is None
                   else f"{t['disk_written_per_hit'] / 2**20:.2f}Mi")
        print(f"  {r.name:<20}{r.hit_rate:>9.3f}{r.ttft_ms():>14.1f}{r.ttft_ms(0.5):>8.1f}"
              f"{r.ttft_ms(0.99):>8.1f}{r.wall_s:>8.1f}{ratio:>14}{per_hit:>12}"
              f"{r.load_average:>6.1f}")
    print(f"  ideal (infinite cache, last block computed as the engine does): {ideal:.3f}")
    for r in results:
        s = r.tier_stats
        if "kv_tier_host_hits_total" in s:
            print(f"  {r.name}: host hits {s['kv_tier_host_hits_total']} blocks, disk hits "
                  f"{s.get('kv_tier_disk_hits_total', 0)}, spilled "
                  f"{s['kv_tier_spilled_bytes_total'] / 2**20:.1f} MiB, restored "
                  f"{s['kv_tier_restored_bytes_total'] / 2**20:.1f} MiB, disk written "
                  f"{s['kv_tier_disk_written_bytes_total'] / 2**20:.1f} MiB, read "
                  f"{s['kv_tier_disk_read_bytes_total'] / 2**20:.1f} MiB, spills dropped "
                  f"{s['kv_tier_spills_dropped_total']}, checksum failures "
                  f"{s['kv_tier_checksum_failures_total']}, I/O errors "
                  f"{s['kv_tier_io_errors_total']}")


def figures_of(r: ReplayResult) -> Dict[str, object]:
    out: Dict[str, object] = {
        f"hit_rate_{r.name}": r.hit_rate, f"ttft_ms_{r.name}": r.ttft_ms(),
        f"ttft_p50_ms_{r.name}": r.ttft_ms(0.5), f"ttft_p99_ms_{r.name}": r.ttft_ms(0.99),
        f"replay_wall_s_{r.name}": r.wall_s, f"preemptions_{r.name}": r.num_preemptions}
    if r.name != "device_only":
        keys = ("host_hits_total", "disk_hits_total", "spilled_bytes_total",
                "restored_bytes_total", "disk_written_bytes_total", "disk_read_bytes_total",
                "spills_dropped_total", "checksum_failures_total", "io_errors_total")
        out.update({f"{r.name}_{k}": r.tier_stats.get(f"kv_tier_{k}") for k in keys})
        out.update({f"{k}_{r.name}": v for k, v in traffic(r).items()})
    return out


def plot_ttft(results: Sequence[ReplayResult], path: Path, title: str) -> None:
    """Box plot of TTFT per configuration (log scale), mean marked; a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 * len(results) + 3, 4.5))
    data = [[1e3 * t for t in r.ttft_s] for r in results]
    ax.boxplot(data, whis=(1, 99), showmeans=True, showfliers=False)
    ax.set_xticks(range(1, len(results) + 1), [r.name for r in results], rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms), whiskers p1-p99, triangle = mean")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_sweep(sweep: Sequence[SweepRound]) -> List[Dict[str, object]]:
    """A table of TTFT per offered load and config, with the ratio to device-only at that load;
    returns its rows for the JSON figures."""
    print(f"\n  {'load':>6}{'req/s':>7}  {'config':<20}{'hit rate':>9}{'TTFT mean':>11}{'p50':>8}"
          f"{'p99':>8}{'mean/dev':>10}{'p99/dev':>9}")
    rows = []
    for load, rate, results in sweep:
        base = next((r for r in results if r.name == "device_only"), None)
        for r in results:
            row = {"load": load, "rate_req_s": rate, "config": r.name, "hit_rate": r.hit_rate,
                   "ttft_ms": r.ttft_ms(), "ttft_p50_ms": r.ttft_ms(0.5),
                   "ttft_p99_ms": r.ttft_ms(0.99), "wall_s": r.wall_s}
            if base is not None:
                row["ttft_vs_device_only"] = r.ttft_ms() / base.ttft_ms()
                row["ttft_p99_vs_device_only"] = r.ttft_ms(0.99) / base.ttft_ms(0.99)
            rows.append(row)
            ratios = (f"{row['ttft_vs_device_only']:>10.2f}{row['ttft_p99_vs_device_only']:>9.2f}"
                      if base is not None else "")
            print(f"  {load:>6g}{rate:>7.2f}  {r.name:<20}{r.hit_rate:>9.3f}{r.ttft_ms():>11.1f}"
                  f"{r.ttft_ms(0.5):>8.1f}{r.ttft_ms(0.99):>8.1f}{ratios}")
    return rows


def plot_load_sweep(sweep: Sequence[SweepRound], path: Path, title: str) -> None:
    """Mean and p99 TTFT against offered load, a line per config; a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    sweep = sorted(sweep, key=lambda round_: round_[0] or 0.0)
    names = [r.name for r in sweep[0][2]]
    loads = [load for load, _, _ in sweep]
    for name in names:
        picked = [next(r for r in results if r.name == name) for _, _, results in sweep]
        axes[0].plot(loads, [r.ttft_ms() for r in picked], marker="o", label=name)
        axes[1].plot(loads, [r.ttft_ms(0.99) for r in picked], marker="o", label=name)
    for ax, what in zip(axes, ("mean", "p99")):
        ax.set_xlabel("offered load (fraction of device-only's sustained rate)")
        ax.set_ylabel(f"TTFT {what} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(figures: Dict[str, object]) -> Dict[str, object]:
    """The issue's targets, met or not, for whatever parts ran; printed and returned."""
    met: Dict[str, bool] = {}
    print("\ntargets:")
    if "host_copy_ratio" in figures:
        met["host_copy_ratio_ge_0.8"] = figures["host_copy_ratio"] >= TARGET_COPY_RATIO
        print(f"  tier copies >= {TARGET_COPY_RATIO:.0%} of plain copy_: "
              f"{figures['host_copy_ratio']:.2f} -> {_met(met['host_copy_ratio_ge_0.8'])}")
    if "disk_ratio" in figures:
        met["disk_ratio_ge_0.8"] = figures["disk_ratio"] >= TARGET_DISK_RATIO
        print(f"  disk >= {TARGET_DISK_RATIO:.0%} of raw O_DIRECT: {figures['disk_ratio']:.2f} "
              f"-> {_met(met['disk_ratio_ge_0.8'])}")
    out: Dict[str, object] = {"targets_met": met}
    tiered = [c for c in figures.get("configs", []) if c != "device_only"]
    if "ttft_ms_device_only" not in figures or not tiered:
        return out
    per_config = {c: replay_targets(figures, c) for c in tiered}
    for name, result in per_config.items():
        print(f"  {name}: hit rate {result['hit_frac_of_ideal']:.2f} of ideal (>= "
              f"{TARGET_HIT_OF_IDEAL:.0%}), mean TTFT {result['mean_ttft_gain']:.0%} below "
              f"device-only (>= {TARGET_TTFT_GAIN:.0%}), p99 TTFT "
              f"{result['p99_ttft_vs_device_only']:.2f}x device-only (<= 1) -> "
              f"{_met(result['all_met'])}")
    winners = [c for c, result in per_config.items() if result["all_met"]]
    reference = DEFAULT_TIER_CONFIG if DEFAULT_TIER_CONFIG in per_config else tiered[0]
    met.update({f"{reference}_{k}": v for k, v in per_config[reference].items()
                if isinstance(v, bool)})
    print(f"  configs meeting all three: {', '.join(winners) or 'none'}")
    out.update({"replay_targets": per_config, "configs_meeting_targets": winners})
    return out


def replay_targets(figures: Dict[str, object], name: str) -> Dict[str, object]:
    """One tiered config's figures against device-only's in the same run."""
    ideal, base = figures["ideal_hit_rate"], figures["ttft_ms_device_only"]
    hit_frac = figures[f"hit_rate_{name}"] / ideal if ideal else 1.0
    gain = 1 - figures[f"ttft_ms_{name}"] / base
    p99 = figures[f"ttft_p99_ms_{name}"] / figures["ttft_p99_ms_device_only"]
    flags = {"hit_rate_ge_0.95_ideal": hit_frac >= TARGET_HIT_OF_IDEAL,
             "mean_ttft_ge_20pct_below_device_only": gain >= TARGET_TTFT_GAIN,
             "p99_ttft_not_above_device_only": p99 <= 1.0}
    return {"hit_frac_of_ideal": hit_frac, "mean_ttft_gain": gain,
            "p99_ttft_vs_device_only": p99, **flags, "all_met": all(flags.values())}


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"
