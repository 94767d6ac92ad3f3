"""Part (c) of ``bench_kv_tiers.py``: a Mooncake-format trace replayed through the real engine
under several tier configurations, one after another, same prompts, same order.

A configuration is named ``device_only`` or ``<eviction>[_<write policy>]``: ``lru``,
``hotness`` (write-through, the default policy), ``lru_selective``, ``lru_write_back``,
``hotness_write_back``, ... (``kv/write_policy.py``).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from traces import TraceRequest
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams

MIN_TOKEN_ID = 3  # stay clear of the special tokens at the lowest ids
EVICTIONS = ("lru", "hotness")
WRITE_SUFFIXES = {"": "write_through", "selective": "write_through_selective",
                  "write_back": "write_back"}


def parse_config_name(name: str) -> Optional[tuple]:
    """``(eviction, write policy)`` of a configuration name, None for ``device_only``; raises
    ValueError naming the accepted forms."""
    if name == "device_only":
        return None
    eviction, _, suffix = name.partition("_")
    if eviction not in EVICTIONS or suffix not in WRITE_SUFFIXES:
        raise ValueError(f"--configs: {name!r} is not device_only or <eviction>[_<write>] with "
                         f"eviction in {'/'.join(EVICTIONS)} and write in "
                         f"{'/'.join(s for s in WRITE_SUFFIXES if s)} (none: write-through)")
    return eviction, WRITE_SUFFIXES[suffix]


@dataclass(frozen=True)
class TierSizes:
    device: int
    host: int
    disk: int
    unique: int


def tier_sizes(rows: Sequence[TraceRequest], device_frac: float, host_frac: float,
               disk_frac: float, block_size: int) -> TierSizes:
    """Tier sizes in blocks, as fractions of the rows' unique blocks; the device pool holds at
    least twice the longest request."""
    unique = len({r.hash_ids[:i + 1] for r in rows for i in range(len(r.hash_ids))})
    longest = max(len(r.hash_ids) + -(-r.num_output_tokens // block_size) for r in rows)
    device = max(round(device_frac * unique), 2 * longest)
    return TierSizes(device, max(1, round(host_frac * unique)),
                     max(1, round(disk_frac * unique)), unique)


def fit_context(rows: Sequence[TraceRequest], max_output: int, block_size: int,
                max_model_len: int) -> List[TraceRequest]:
    """Outputs capped at ``max_output``; prompts cut to whole blocks that fit the context."""
    fitted = []
    for r in rows:
        output = min(r.num_output_tokens, max_output, max_model_len - 1)
        max_blocks = max(1, (max_model_len - output) // block_size)
        fitted.append(replace(r, hash_ids=r.hash_ids[:max_blocks], num_output_tokens=output))
    return fitted


@dataclass
class ReplayResult:
    name: str
    wall_s: float
    ttft_s: List[float]
    hit_rate: float
    num_preemptions: int
    tier_stats: Dict[str, object]
    load_average: float = 0.0  # 1-minute load average right after the run

    def ttft_ms(self, q: Optional[float] = None) -> float:
        if q is None:
            return 1e3 * statistics.fmean(self.ttft_s)
        ordered = sorted(self.ttft_s)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_config(name: str, model: str, block_size: int, in_flight: int, sizes: TierSizes,
                  disk_root: Path, write_threshold: int = 1,
                  spill_gbps: Optional[float] = None) -> EngineConfig:
    common = dict(model=model, block_size=block_size, num_kv_blocks=sizes.device,
                  max_num_seqs=in_flight, device="cpu")
    parsed = parse_config_name(name)
    if parsed is None:
        return EngineConfig(**common)
    eviction, write_policy = parsed
    return EngineConfig(**common, host_kv_blocks=sizes.host, disk_kv_dir=str(disk_root / name),
                        disk_kv_blocks=sizes.disk, kv_eviction=eviction,
                        kv_write_policy=write_policy, kv_write_threshold=write_threshold,
                        kv_spill_gbps=spill_gbps)


def replay(name: str, config: EngineConfig, prompts: Sequence[List[int]],
           outputs: Sequence[int], vocab_size: int) -> ReplayResult:
    """Closed loop: ``max_num_seqs`` requests in flight; TTFT per request, hit rate of the run."""
    with LLMEngine(config) as engine:
        warm = random.Random("warm-up")  # tokens no trace block has, so nothing hits on them
        _drain(engine, [warm.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(40)], 2)
        kv = engine.scheduler.kv
        queries, hits = kv.num_prefix_queries, kv.num_prefix_hits
        preemptions = engine.scheduler.num_preemptions
        added: Dict[str, float] = {}
        ttft: Dict[str, float] = {}
        pending = list(range(len(prompts)))[::-1]
        num_running = 0
        started = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and num_running < config.max_num_seqs:
                i = pending.pop()
                added[str(i)] = time.perf_counter()
                engine.add_request(prompts[i], _params(outputs[i]), request_id=str(i))
                num_running += 1
            for out in engine.step():
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - added[out.request_id]
                num_running -= out.finished
        wall_s = time.perf_counter() - started
        num_queries = kv.num_prefix_queries - queries
        result = ReplayResult(name, wall_s, list(ttft.values()),
                              (kv.num_prefix_hits - hits) / num_queries if num_queries else 0.0,
                              engine.scheduler.num_preemptions - preemptions,
                              engine.kv_tier_stats())
    result.load_average = os.getloadavg()[0]
    return result


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drain(engine: LLMEngine, prompt: List[int], max_tokens: int) -> None:
    engine.add_request(prompt, _params(max_tokens), request_id="warm-up")
    while engine.has_unfinished():
        engine.step()


# ----- reporting -----


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
