"""The serving benchmark's workload: trace rows -> the requests replayed, and the sizes that put a
trace under KV pressure near saturation (``scripts/bench_serve.py`` describes the run).

* `with_system_prompt`: every row's prompt starts with the same hash blocks (a shared system
  prompt), as in agent and chat traces.
* `build_workload`: scaled lengths, token-id prompts that share exactly what the hash ids share,
  arrival times (all seeded).
* `working_set_blocks` / `auto_kv_blocks`: the KV blocks the replayed requests touch, and a
  group pool that the working set overfills by a chosen ratio.
* `poisson_rate`: ``--rate auto``'s arithmetic, a fraction of a measured sustained rate.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from scripts.traces import MOONCAKE_BLOCK_TOKENS, BlockTokens, TraceRequest

MIN_PROMPT_TOKEN_ID = 100  # random prompts stay clear of the special tokens at the low ids
# Hash ids of the shared system prompt: negative, so they never collide with a trace's own.
SYSTEM_PROMPT_FIRST_ID = -1


@dataclass(frozen=True)
class Scaling:
    prompt_scale: int
    max_output: int
    arrival: str  # "poisson" or "trace"
    rate_req_s: Optional[float]  # poisson
    time_scale: float  # trace: arrival times divided by this


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: List[int]
    max_tokens: int
    arrival_s: float


def with_system_prompt(rows: Sequence[TraceRequest], num_blocks: int) -> List[TraceRequest]:
    """Every row with the same ``num_blocks`` hash blocks (512 trace tokens each) in front."""
    if num_blocks <= 0:
        return list(rows)
    head = tuple(range(SYSTEM_PROMPT_FIRST_ID, SYSTEM_PROMPT_FIRST_ID - num_blocks, -1))
    return [replace(r, num_prompt_tokens=r.num_prompt_tokens + num_blocks * MOONCAKE_BLOCK_TOKENS,
                    hash_ids=head + r.hash_ids) for r in rows]


def build_workload(trace: Sequence[TraceRequest], scaling: Scaling, vocab_size: int,
                   max_model_len: int, seed: int) -> List[BenchRequest]:
    """The requests to replay: scaled lengths, prompts, arrival times (all seeded).

    A hash id becomes ``512 / prompt_scale`` seeded token ids (the same wherever it appears), so
    prompts share exactly the prefixes their hash ids share; a row without hash ids (Azure) gets
    seeded random ids. Lengths are clamped to the model's context."""
    rng = random.Random(seed)
    low = min(MIN_PROMPT_TOKEN_ID, vocab_size // 2)
    blocks = BlockTokens(max(1, MOONCAKE_BLOCK_TOKENS // scaling.prompt_scale), vocab_size, low,
                         seed)
    arrivals = arrival_times(trace, scaling, rng)
    requests = []
    for row, arrival in zip(trace, arrivals):
        max_tokens = max(1, min(row.num_output_tokens, scaling.max_output, max_model_len - 1))
        num_prompt = max(1, min(math.ceil(row.num_prompt_tokens / scaling.prompt_scale),
                                max_model_len - max_tokens))
        prompt = blocks.prompt(row.hash_ids)[:num_prompt]
        prompt += [rng.randrange(low, vocab_size) for _ in range(num_prompt - len(prompt))]
        requests.append(BenchRequest(prompt, max_tokens, arrival))
    return requests


def arrival_times(trace: Sequence[TraceRequest], scaling: Scaling,
                  rng: random.Random) -> List[float]:
    if scaling.arrival == "trace":
        return [row.arrival_s / scaling.time_scale for row in trace]
    return poisson_times(len(trace), scaling.rate_req_s, rng)


def poisson_times(num: int, rate_req_s: float, rng: random.Random) -> List[float]:
    """``num`` arrival times, the first at 0, exponential gaps of mean ``1 / rate_req_s``."""
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate_req_s)
    return times


def with_rate(requests: Sequence[BenchRequest], rate_req_s: float,
              seed: int) -> List[BenchRequest]:
    """The same requests, Poisson arrivals at ``rate_req_s`` (seeded)."""
    times = poisson_times(len(requests), rate_req_s, random.Random(seed))
    return [replace(r, arrival_s=t) for r, t in zip(requests, times)]


# ----- KV pressure -----


def working_set_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    """KV blocks the requests touch: each distinct full prompt block once (a prefix cache that
    kept everything would hold it once: blocks are told apart by their whole prefix, as the
    engine's chained hashes do), plus each request's own partial block and output blocks."""
    seen: set = set()
    num_own = 0
    for r in requests:
        seen.update(_block_keys(r.prompt_ids, block_size))
        num_full = len(r.prompt_ids) // block_size
        num_own += math.ceil((len(r.prompt_ids) - num_full * block_size + r.max_tokens)
                             / block_size)
    return len(seen) + num_own


def ideal_hit_rate(requests: Sequence[BenchRequest], block_size: int) -> float:
    """The prefix-cache hit rate (cached prompt tokens / prompt tokens) of one group with an
    endless pool serving the requests one at a time in arrival order: every full block computed
    stays cached, and a prompt reuses at most ``(len - 1) // block_size`` leading blocks, as the
    engine looks them up. No router on any number of groups does better: more groups compute a
    shared block once each, and a turn that arrives while the one before it runs finds less."""
    seen: set = set()
    hits = queries = 0
    for r in requests:
        keys = _block_keys(r.prompt_ids, block_size)
        lookable = (len(r.prompt_ids) - 1) // block_size
        num_hit = next((i for i, key in enumerate(keys[:lookable]) if key not in seen), lookable)
        hits += num_hit * block_size
        queries += len(r.prompt_ids)
        seen.update(keys)
    return hits / queries if queries else 0.0


def _block_keys(prompt_ids: Sequence[int], block_size: int) -> List[Tuple]:
    """One key per full block, telling blocks apart by their whole prefix (as the engine's
    chained block hashes do)."""
    keys: List[Tuple] = []
    key: Tuple = ()
    for i in range(len(prompt_ids) // block_size):
        key = (hash(key), tuple(prompt_ids[i * block_size:(i + 1) * block_size]))
        keys.append(key)
    return keys


def longest_request_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    return max(math.ceil((len(r.prompt_ids) + r.max_tokens) / block_size) for r in requests)


def auto_kv_blocks(working_set: int, longest: int, ratio: float,
                   min_longest_multiple: int = 2) -> Tuple[int, str]:
    """(pool blocks per group, why): ``working_set / ratio``, but at least
    ``min_longest_multiple`` times the longest request (a group must hold a few at once)."""
    wanted = math.ceil(working_set / ratio)
    floor = min_longest_multiple * longest
    if wanted >= floor:
        return wanted, f"working set {working_set} blocks / {ratio:g}"
    return floor, (f"{min_longest_multiple} x the longest request ({longest} blocks); the "
                   f"working set / {ratio:g} would be {wanted}")


# ----- --rate auto -----


def sustained_rate(num_requests: int, duration_s: float) -> float:
    """Requests per second of a run that had them all queued from the start."""
    if num_requests < 1 or not duration_s > 0:
        raise ValueError(f"a sustained rate needs requests and a positive duration, got "
                         f"{num_requests} requests in {duration_s} s")
    return num_requests / duration_s


def poisson_rate(sustained_req_s: float, load: float) -> float:
    """The arrival rate of ``--rate auto``: ``load`` (0 < load) times the sustained rate."""
    if not load > 0:
        raise ValueError(f"--load must be positive, got {load}")
    return load * sustained_req_s


def calibration_sample(requests: Sequence[BenchRequest], num: int) -> List[BenchRequest]:
    """``num`` requests spread evenly over the workload, all arriving at once."""
    num = max(1, min(num, len(requests)))
    step = len(requests) / num
    return [replace(requests[int(i * step)], arrival_s=0.0) for i in range(num)]


def workload_figures(requests: Sequence[BenchRequest], block_size: int) -> Dict[str, float]:
    return {"workload_prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "workload_output_tokens": sum(r.max_tokens for r in requests),
            "working_set_blocks": working_set_blocks(requests, block_size),
            "ideal_prefix_hit_rate": round(ideal_hit_rate(requests, block_size), 3),
            "longest_request_blocks": longest_request_blocks(requests, block_size)}
