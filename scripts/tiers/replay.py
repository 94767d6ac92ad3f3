"""Part (c) of ``bench_kv_tiers.py``: a Mooncake-format trace replayed through the real engine
under several tier configurations, one after another, same prompts, same order.

A configuration is named ``device_only`` or ``<eviction>[_<write policy>]``: ``lru``,
``hotness`` (write-through, the default policy), ``lru_selective``, ``lru_write_back``,
``hotness_write_back``, ... (``kv/tiers/write_policy.py``).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from scripts.traces import TraceRequest
from workers.config import EngineConfig
from workers.engine import LLMEngine, RequestOutput
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
           outputs: Sequence[int], vocab_size: int,
           arrivals: Optional[Sequence[float]] = None) -> ReplayResult:
    """Closed loop when ``arrivals`` is None: ``max_num_seqs`` requests in flight, the next added
    when one finishes, TTFT from its ``add_request``. Open loop otherwise: request ``i`` arrives
    ``arrivals[i]`` seconds after the start whatever is running (the engine runs
    ``max_num_seqs`` of them and queues the rest) and its TTFT counts from that arrival."""
    with LLMEngine(config) as engine:
        warm = random.Random("warm-up")  # tokens no trace block has, so nothing hits on them
        _drain(engine, [warm.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(40)], 2)
        kv = engine.scheduler.kv
        queries, hits = kv.num_prefix_queries, kv.num_prefix_hits
        preemptions = engine.scheduler.num_preemptions
        due = _Due(len(prompts), arrivals, config.max_num_seqs)
        arrived: Dict[str, float] = {}
        ttft: Dict[str, float] = {}
        started = time.perf_counter()
        while due.pending or engine.has_unfinished():
            now = time.perf_counter() - started
            for i in due.take(now):
                arrived[str(i)] = started + (now if arrivals is None else arrivals[i])
                engine.add_request(prompts[i], _params(outputs[i]), request_id=str(i))
            if not engine.has_unfinished():
                time.sleep(max(0.0, due.next_arrival() - now))  # open loop, nothing arrived yet
                continue
            next_in = due.next_arrival() - now if due.pending and arrivals is not None else None
            for out in _step(engine, next_in):
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - arrived[out.request_id]
                due.num_running -= out.finished
        wall_s = time.perf_counter() - started
        num_queries = kv.num_prefix_queries - queries
        result = ReplayResult(name, wall_s, list(ttft.values()),
                              (kv.num_prefix_hits - hits) / num_queries if num_queries else 0.0,
                              engine.scheduler.num_preemptions - preemptions,
                              engine.kv_tier_stats())
    result.load_average = os.getloadavg()[0]
    return result


class _Due:
    """Which requests to add now: in order, while fewer than ``max_in_flight`` run (closed
    loop), or those whose arrival time has come (open loop)."""

    def __init__(self, num: int, arrivals: Optional[Sequence[float]], max_in_flight: int):
        if arrivals is not None and len(arrivals) != num:
            raise ValueError(f"{len(arrivals)} arrival times for {num} requests")
        self.pending = list(range(num))[::-1]
        self.arrivals = arrivals
        self.max_in_flight = max_in_flight
        self.num_running = 0

    def take(self, now: float) -> List[int]:
        taken = []
        while self.pending and (
                self.num_running < self.max_in_flight if self.arrivals is None
                else self.arrivals[self.pending[-1]] <= now):
            taken.append(self.pending.pop())
            self.num_running += 1
        return taken

    def next_arrival(self) -> float:
        assert self.arrivals is not None and self.pending
        return self.arrivals[self.pending[-1]]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drain(engine: LLMEngine, prompt: List[int], max_tokens: int) -> None:
    engine.add_request(prompt, _params(max_tokens), request_id="warm-up")
    while engine.has_unfinished():
        _step(engine)


def _step(engine: LLMEngine, next_arrival_in: Optional[float] = None) -> List[RequestOutput]:
    """One engine step; first, while only spills that ``--kv-spill-gbps`` holds back are left,
    a wait for the bound (or the next arrival, if sooner) instead of an empty step."""
    engine.wait_while_idle(None if next_arrival_in is None else max(0.0, next_arrival_in))
    return engine.step()
