"""Benchmark the serving stack under a replayed trace: tpserve's KV-aware router against Serve's
default power-of-two-choices router, same load, same run.

One local Ray; for each router in turn a fresh Serve application (``cluster.app.build_app``: the
OpenAI ingress in front of ``--groups`` TP groups of ``--tp`` ranks), a short warm-up, then the
same requests at the same arrival times, sent with the official ``openai`` client
(``AsyncOpenAI``, streaming ``/v1/completions``, token-id prompts, greedy, ``ignore_eos`` so every
request generates exactly its ``max_tokens``). The baseline differs from tpserve only in the group
deployment's ``request_router_config``: Serve's default class (``PowerOfTwoChoicesRequestRouter``)
with the same routing-stats period.

Trace (``--trace``, format detected from the content):

* Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``. No token contents: every
  prompt is seeded random token ids, so no two prompts share a prefix.
* Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``, one
  hash id per 512-token block. Each hash id becomes a fixed block of ``512 / prompt_scale`` token
  ids drawn from a generator seeded by the id, so requests that share hash ids share real prompt
  prefixes (and the prefix cache can hit).

Scaling, so that a run approaches saturation on a small CPU host within minutes (printed with the
results): prompt lengths divided by ``--prompt-scale``, output lengths capped at ``--max-output``,
both clamped to the model's context; the first ``--num-requests`` requests; arrivals Poisson at
``--rate`` requests/s (seeded), or the trace's own times sped up by ``--time-scale``. The defaults
(200 Azure code requests, prompts / 16, outputs <= 32, 2.2 requests/s, 2 groups of TP 1 with 512
KV blocks each) were chosen on a 2-core host: there the same requests sent all at once finish at
about 2.4-2.8 requests/s (38-45 output tokens/s), so 2.2/s keeps both groups busy most of the run
without an unbounded queue, and the whole script takes about 5 minutes.

Per request: TTFT (request sent to the first streamed token), inter-token latencies (the gaps
between streamed chunks that carry tokens; ``logprobs=0`` is requested so every token shows up in
the stream even when its text is held back), end-to-end latency. Throughput: output tokens of
successful requests over the run (first send to last response). Requests that fail, end short or
are cut at the run's deadline are counted as failures by kind; arrivals past ``--max-duration-s``
are counted as not sent.

Router decision time: the KV-aware router records the time of each placement decision it makes
(``KVAwareRouter.decision_times_us``: reading the groups' loads, ``rank_groups``, charging the
choice). The routers live in the ingress replica's process, so they are read there through Ray's
``__ray_call__`` after the KV run: this is the live figure, with ``--groups`` groups. The pure
policy ``cluster.placement.rank_groups`` is also timed here, in this process, on synthetic loads
of 2 and 64 groups (the target: under 50 us with 64 groups).

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):  # run from anywhere, or imported by path (tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from traces import (AZURE_CODE_TRACE, MOONCAKE_BLOCK_TOKENS, BlockTokens,  # noqa: E402
                    TraceError, TraceRequest, read_trace)

DEFAULT_TRACE = AZURE_CODE_TRACE
APP_NAME = "tpserve-bench"
ROUTERS = ("kv", "pow2")
MIN_PROMPT_TOKEN_ID = 100  # random prompts stay clear of the special tokens at the low ids
WARMUP_PROMPT_TOKENS = 32
WARMUP_MAX_TOKENS = 4
METRICS_SAMPLE_PERIOD_S = 1.0
OTHER_CPU_WARN_FRAC = 0.10


# ----- the workload -----


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


def build_workload(trace: Sequence[TraceRequest], scaling: Scaling, vocab_size: int,
                   max_model_len: int, seed: int) -> List[BenchRequest]:
    """The requests to replay: scaled lengths, prompts, arrival times (all seeded)."""
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
    times, now = [], 0.0
    for _ in trace:
        times.append(now)
        now += rng.expovariate(scaling.rate_req_s)
    return times


# ----- one run of the load against an endpoint -----


@dataclass
class RequestResult:
    num_expected_tokens: int
    sent_at: Optional[float] = None  # perf_counter
    ended_at: Optional[float] = None
    ttft_s: Optional[float] = None
    itl_s: List[float] = field(default_factory=list)
    num_streamed_tokens: int = 0
    num_output_tokens: Optional[int] = None  # from the usage chunk
    error: Optional[str] = None

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.ended_at is not None

    @property
    def e2e_s(self) -> Optional[float]:
        return None if self.ended_at is None else self.ended_at - self.sent_at


@dataclass
class RunResult:
    router: str
    results: List[RequestResult]
    num_not_sent: int
    start: float
    kv_usage_peak: Dict[str, float] = field(default_factory=dict)  # by group
    group_counters: Dict[str, Dict[str, float]] = field(default_factory=dict)  # group -> name
    router_stats: Optional[Dict[str, Any]] = None
    other_cpu_frac: Optional[float] = None  # of the machine, used by processes not ours


def _chunk_tokens(chunk: Any) -> int:
    if not chunk.choices:
        return 0
    choice = chunk.choices[0]
    if choice.logprobs is not None and choice.logprobs.tokens is not None:
        return len(choice.logprobs.tokens)
    return 1 if choice.text else 0


_logged_errors: set = set()  # the kinds of request error already logged (once each)


async def send_request(client: Any, model: str, request: BenchRequest,
                       result: RequestResult) -> None:
    result.sent_at = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=request.prompt_ids, max_tokens=request.max_tokens,
            temperature=0.0, logprobs=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.num_output_tokens = chunk.usage.completion_tokens
            num_tokens = _chunk_tokens(chunk)
            if num_tokens:
                if result.ttft_s is None:
                    result.ttft_s = now - result.sent_at
                else:
                    result.itl_s.append(now - last)
                last = now
                result.num_streamed_tokens += num_tokens
    except Exception as exc:  # counted and reported, never dropped
        result.error = type(exc).__name__
        if result.error not in _logged_errors:
            _logged_errors.add(result.error)
            log(f"first {result.error}: {str(exc)[:300]}")
    result.ended_at = time.perf_counter()
    if result.error is None and (result.num_output_tokens or result.num_streamed_tokens) \
            != result.num_expected_tokens:
        result.error = "incomplete"


async def replay(base_url: str, model: str, requests: Sequence[BenchRequest], router: str,
                 max_duration_s: float, drain_timeout_s: float,
                 request_timeout_s: float) -> RunResult:
    """Send every request at its arrival time (those past ``max_duration_s`` are not sent);
    wait up to ``drain_timeout_s`` after the last send, then cancel what is left."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                         timeout=request_timeout_s)
    results = [RequestResult(r.max_tokens) for r in requests]
    tasks = []
    start = time.perf_counter()
    run = RunResult(router, results, 0, start)
    sampler = asyncio.create_task(sample_metrics(base_url, run))
    for request, result in zip(requests, results):
        if request.arrival_s > max_duration_s:
            run.num_not_sent += 1
            continue
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        tasks.append(asyncio.create_task(send_request(client, model, request, result)))
    _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s) if tasks else (None, [])
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        if result.sent_at is not None and result.ended_at is None:
            result.error, result.ended_at = "cut_at_deadline", time.perf_counter()
    await asyncio.sleep(1.5 * METRICS_SAMPLE_PERIOD_S)  # the groups push counters every second
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    await client.close()
    return run


async def sample_metrics(base_url: str, run: RunResult) -> None:
    """Every second: each group's KV usage (kept at its peak) and counters, from /metrics."""
    url = base_url.rsplit("/v1", 1)[0] + "/metrics"
    while True:
        try:
            text = await asyncio.to_thread(_get_text, url)
            usage, counters = parse_group_metrics(text)
            for group, value in usage.items():
                run.kv_usage_peak[group] = max(value, run.kv_usage_peak.get(group, 0.0))
            run.group_counters = counters or run.group_counters
        except OSError:
            pass  # a missed sample only lowers the peak's resolution
        await asyncio.sleep(METRICS_SAMPLE_PERIOD_S)


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def parse_group_metrics(text: str) -> Tuple[Dict[str, float], Dict[str, Dict[str, float]]]:
    """(KV usage by group, counters by group) from tpserve's /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    usage: Dict[str, float] = {}
    counters: Dict[str, Dict[str, float]] = {}
    wanted = ("tpserve:num_preemptions_total", "tpserve:prefix_cache_queries_total",
              "tpserve:prefix_cache_hits_total")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            group = sample.labels.get("group", "?")
            if sample.name == "tpserve:kv_cache_usage_perc":
                usage[group] = sample.value
            elif sample.name in wanted:
                counters.setdefault(group, {})[sample.name[len("tpserve:"):-len("_total")]] = \
                    sample.value
    return usage, counters


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
    def total(name: str) -> float:
        return sum(c.get(name, 0.0) for c in run.group_counters.values())

    queries = total("prefix_cache_queries")  # prompt tokens looked up: each prefill, per group
    return {
        "num_sent": len(sent), "num_ok": len(ok), "num_failed": len(sent) - len(ok),
        "num_not_sent": run.num_not_sent, "failures": failures,
        "duration_s": round(window, 2), "output_tokens": out_tokens,
        "throughput_tok_s": round(out_tokens / window, 2) if window else 0.0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)), "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "kv_usage_peak": round(max(run.kv_usage_peak.values(), default=0.0), 3),
        "kv_usage_peak_by_group": sorted(round(v, 3) for v in run.kv_usage_peak.values()),
        "prefill_tokens_by_group": sorted(int(c.get("prefix_cache_queries", 0))
                                          for c in run.group_counters.values()),
        "num_preemptions": int(total("num_preemptions")),
        "prefix_hit_rate": round(total("prefix_cache_hits") / queries, 3) if queries else None,
        "other_cpu_frac": run.other_cpu_frac,
    }


# ----- the placement policy timed in this process -----


def time_rank_groups(num_groups: int, num_calls: int = 2000, seed: int = 0) -> float:
    """p50 microseconds of `cluster.placement.rank_groups` over realistic synthetic loads: pools
    of 512 blocks 10-90% used, 2048 cached hashes per group, a 16-block request whose prefix a
    few groups hold (so the prefix scan runs too)."""
    from cluster.placement import GroupLoad, RequestDemand, rank_groups

    rng = random.Random(seed)
    demand = RequestDemand(256, tuple(rng.getrandbits(63) for _ in range(16)), 16)
    loads = []
    for g in range(num_groups):
        cached = {rng.getrandbits(63) for _ in range(2048)}
        if g % 8 == 0:
            cached.update(demand.block_hashes[:rng.randrange(1, 16)])
        loads.append(GroupLoad(f"group-{g}", rng.randrange(51, 461), 512, 16, rng.randrange(512),
                               frozenset(cached), 1, rng.random(), rng.randrange(256)))
    for _ in range(num_calls // 10):  # warm caches before timing
        rank_groups(demand, loads)
    times = []
    for _ in range(num_calls):
        begin = time.perf_counter_ns()
        rank_groups(demand, loads)
        times.append((time.perf_counter_ns() - begin) / 1000)
    return round(percentile(times, 50), 2)


# ----- CPU used by other processes during a run (a shared host skews a comparison) -----


def cpu_snapshot() -> Optional[Tuple[float, float, float]]:
    """(wall time, busy CPU seconds of the machine, CPU seconds of this process and its
    descendants: Ray's processes and workers), from /proc; None where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        children: Dict[int, List[int]] = {}
        usage: Dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # exited meanwhile
                children.setdefault(int(fields[1]), []).append(int(entry))
                usage[int(entry)] = int(fields[11]) + int(fields[12])  # utime + stime
    except OSError:
        return None
    mine, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        mine += usage.get(pid, 0)
        todo.extend(children.get(pid, ()))
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return time.monotonic(), busy / hz, mine / hz


def other_cpu_frac(before: Optional[Tuple[float, float, float]],
                   after: Optional[Tuple[float, float, float]]) -> Optional[float]:
    """Fraction of the machine's CPU capacity used by processes outside this benchmark."""
    if before is None or after is None:
        return None
    wall, busy, mine = (a - b for a, b in zip(after, before))
    return round(max(0.0, (busy - mine) / (wall * (os.cpu_count() or 1))), 3)


# ----- Serve: the application under each router -----


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_bench_app(config: Any, router: str) -> Any:
    """tpserve's application with the given router ("kv", or Serve's default "pow2")."""
    import dataclasses

    import ray

    from cluster.app import build_app

    return build_app(dataclasses.replace(config, router=router), ray.cluster_resources())


def _routers_in_process(_replica: Any) -> Dict[str, Any]:
    """Runs inside the ingress replica (``__ray_call__``): its KV-aware routers' records."""
    from cluster import kv_router

    routers = kv_router.live_routers()
    counts: Dict[str, int] = {}
    for router in routers:
        for reason, n in router.decision_counts().items():
            counts[reason] = counts.get(reason, 0) + n
    return {"num_routers": len(routers), "counts": counts,
            "times_us": [t for router in routers for t in router.decision_times_us()]}


def read_router_stats() -> Dict[str, Any]:
    """The KV-aware routers' decision counts and times, from every ingress replica."""
    import ray
    from ray import cloudpickle

    module = sys.modules[_routers_in_process.__module__]
    if module.__name__ != "__main__":  # imported (tests): not importable in the replica
        cloudpickle.register_pickle_by_value(module)
    merged: Dict[str, Any] = {"num_routers": 0, "counts": {}, "times_us": []}
    prefix = f"SERVE_REPLICA::{APP_NAME}#OpenAIIngress#"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not actor["name"].startswith(prefix):
            continue
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        got = ray.get(handle.__ray_call__.remote(_routers_in_process), timeout=60)
        merged["num_routers"] += got["num_routers"]
        merged["times_us"] += got["times_us"]
        for reason, n in got["counts"].items():
            merged["counts"][reason] = merged["counts"].get(reason, 0) + n
    return merged


def since(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    """Router records of the measured run alone (the warm-up's taken out)."""
    counts = {k: n - before["counts"].get(k, 0) for k, n in after["counts"].items()}
    return {"num_routers": after["num_routers"], "times_us": after["times_us"][
        len(before["times_us"]):], "counts": {k: n for k, n in counts.items() if n}}


async def warm_up(base_url: str, model: str, num_requests: int, vocab_size: int) -> None:
    """A few short requests, so no measured request pays for first-call costs."""
    from openai import AsyncOpenAI

    low = min(MIN_PROMPT_TOKEN_ID, vocab_size // 2)
    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                           timeout=300) as client:
        await asyncio.gather(*(client.completions.create(
            model=model, prompt=[low + (i * 31 + j) % (vocab_size - low)
                                 for j in range(WARMUP_PROMPT_TOKENS)],
            max_tokens=WARMUP_MAX_TOKENS, temperature=0.0) for i in range(num_requests)))
    await asyncio.sleep(1.5)  # routing stats reach the router (3 periods of 0.5 s)


def run_router(router: str, config: Any, args: argparse.Namespace, model: str, port: int,
               vocab_size: int, requests: Sequence[BenchRequest]) -> RunResult:
    from ray import serve

    from cluster.metrics import kill_metrics_store

    base_url = f"http://127.0.0.1:{port}/v1"
    log(f"[{router}] deploying {args.groups} groups x TP {args.tp}")
    serve.run(build_bench_app(config, router), name=APP_NAME, route_prefix="/")
    try:
        asyncio.run(warm_up(base_url, model, 2 * args.groups, vocab_size))
        before = read_router_stats()
        log(f"[{router}] replaying {len(requests)} requests")
        cpu_before = cpu_snapshot()
        run = asyncio.run(replay(base_url, model, requests, router, args.max_duration_s,
                                 args.drain_timeout_s, args.request_timeout_s))
        run.other_cpu_frac = other_cpu_frac(cpu_before, cpu_snapshot())
        if run.other_cpu_frac is not None and run.other_cpu_frac > OTHER_CPU_WARN_FRAC:
            log(f"[{router}] WARNING: other processes used {run.other_cpu_frac:.0%} of the "
                f"machine's CPU during this run; its figures are not comparable")
        run.router_stats = since(before, read_router_stats())
        if (run.router_stats["num_routers"] > 0) != (router == "kv"):
            raise RuntimeError(f"[{router}] found {run.router_stats['num_routers']} KV-aware "
                               f"routers in the ingress: the router swap did not take effect")
    finally:
        serve.delete(APP_NAME)
        kill_metrics_store()
    return run


# ----- report -----


def log(message: str) -> None:
    print(f"bench_serve: {message}", file=sys.stderr, flush=True)


def report(summary: Dict[str, Any], meta: Dict[str, Any]) -> None:
    kv, p2 = summary["kv"], summary["pow2"]
    rows = [("requests ok / failed / not sent", "num_ok", "num_failed", "num_not_sent"),
            ("throughput (output tok/s)", "throughput_tok_s"),
            ("duration (s)", "duration_s"),
            ("TTFT p50 / p99 (ms)", "ttft_p50_ms", "ttft_p99_ms"),
            ("ITL p50 / p99 (ms)", "itl_p50_ms", "itl_p99_ms"),
            ("e2e p50 / p99 (ms)", "e2e_p50_ms", "e2e_p99_ms"),
            ("peak KV usage by group", "kv_usage_peak_by_group"),
            ("prefill tokens by group", "prefill_tokens_by_group"),
            ("preemptions", "num_preemptions"),
            ("prefix-cache hit rate", "prefix_hit_rate"),
            ("CPU used by other processes", "other_cpu_frac")]
    print(f"\ntrace {meta['trace']} ({meta['trace_format']}): {meta['num_requests']} requests, "
          f"{meta['arrival_desc']}")
    print(f"scaling: prompts / {meta['prompt_scale']}, outputs capped at {meta['max_output']}; "
          f"{meta['workload_prompt_tokens']} prompt and {meta['workload_output_tokens']} output "
          f"tokens in all")
    print(f"model {meta['model']} ({meta['dtype']}), {meta['groups']} groups x TP {meta['tp']}, "
          f"KV pool {meta['kv_blocks']} blocks x {meta['block_size']} tokens per group\n")
    print(f"{'':34}{'kv-aware':>20}{'pow2 (Serve default)':>22}")
    for label, *keys in rows:
        cells = [" / ".join(_cell(s[k]) for k in keys) for s in (kv, p2)]
        print(f"{label:34}{cells[0]:>20}{cells[1]:>22}")
    for name, s in (("kv-aware", kv), ("pow2", p2)):
        if s["failures"]:
            print(f"failed requests ({name}) by kind: {s['failures']}")
    r = meta["router"]
    print(f"\nrouter decision time: p50 {r['router_decision_us_p50']} us, p99 "
          f"{r['router_decision_us_p99']} us over {r['num_router_decisions']} live decisions "
          f"({r['router_decision_source']}); reasons {r['router_decisions_by_reason']}")
    print(f"rank_groups alone (this process): p50 {r['rank_groups_us_p50_2_groups']} us with 2 "
          f"groups, {r['rank_groups_us_p50_64_groups']} us with 64")
    ttft, throughput = meta["ttft_p99_kv_over_pow2"], meta["throughput_kv_over_pow2"]
    if ttft is not None:
        print(f"TTFT p99: kv-aware {abs(1 - ttft):.1%} {'lower' if ttft < 1 else 'higher'} than "
              f"pow2 (target: at least 20% lower); throughput kv-aware / pow2 {throughput}")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return " / ".join(str(v) for v in value)
    return "-" if value is None else str(value)


def flat_json(summary: Dict[str, Any], meta: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for router, suffix in (("kv", ""), ("pow2", "_pow2")):
        for key, value in summary[router].items():
            out[key + suffix] = value
    out.update(meta["router"])
    out.update({k: v for k, v in meta.items() if k != "router"})
    return out


# ----- main -----


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="Azure CSV or Mooncake JSONL trace (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--arrival", choices=("poisson", "trace"), default="poisson")
    p.add_argument("--rate", type=float, default=2.2, help="Poisson arrivals per second")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--arrival trace: the trace's times are divided by this")
    p.add_argument("--prompt-scale", type=int, default=16)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--model", default="default", help="'default' or a checkpoint directory")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=512, help="KV pool blocks per group")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-duration-s", type=float, default=240.0,
                   help="per run: arrivals after this are not sent (and counted)")
    p.add_argument("--drain-timeout-s", type=float, default=150.0,
                   help="per run: wait this long after the last send, then cancel the rest")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.prompt_scale < 1 or args.max_output < 1:
        p.error("--num-requests, --prompt-scale and --max-output must be at least 1")
    if args.rate <= 0 or args.time_scale <= 0:
        p.error("--rate and --time-scale must be positive")
    if args.groups < 1:
        p.error("--groups must be at least 1")
    return args


def run_both(args: argparse.Namespace, requests: Sequence[BenchRequest], model_dir: Path,
             vocab_size: int) -> Dict[str, RunResult]:
    import ray
    from ray import serve

    from cluster.app import ServeConfig
    from cluster.metrics import kill_metrics_store
    from workers.config import EngineConfig

    engine = EngineConfig(model=str(model_dir), tp_size=args.tp, block_size=args.block_size,
                          num_kv_blocks=args.kv_blocks, seed=args.seed)
    config = ServeConfig(engine=engine, min_groups=args.groups, max_groups=args.groups,
                         served_model_name=model_dir.name)
    port = free_port()
    # address="local": a fresh instance, never another Ray that happens to run on this host
    ray.init(address="local", num_cpus=args.num_cpus, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        return {router: run_router(router, config, args, model_dir.name, port, vocab_size,
                                   requests) for router in ROUTERS}
    finally:
        serve.shutdown()
        kill_metrics_store()
        ray.shutdown()


def router_figures(kv_stats: Dict[str, Any], rank_us: Dict[int, float]) -> Dict[str, Any]:
    times = kv_stats["times_us"]
    return {
        "router_decision_us_p50": round(percentile(times, 50), 2) if times else rank_us[2],
        "router_decision_us_p99": round(percentile(times, 99), 2) if times else None,
        "router_decision_source": "live KVAwareRouter.choose_replicas in the ingress replica"
        if times else "rank_groups in this process, 2 groups (no live decisions recorded)",
        "num_router_decisions": len(times),
        "router_decisions_by_reason": kv_stats["counts"],
        "rank_groups_us_p50_2_groups": rank_us[2],
        "rank_groups_us_p50_64_groups": rank_us[64],
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    wall_start = time.perf_counter()
    args = parse_args(argv)
    trace_format, trace = read_trace(args.trace, args.num_requests)

    from workers.default_model import resolve_model_path
    from workers.model_config import load_model_config

    model_dir = resolve_model_path(args.model)
    model_config = load_model_config(model_dir)
    scaling = Scaling(args.prompt_scale, args.max_output, args.arrival, args.rate,
                      args.time_scale)
    requests = build_workload(trace, scaling, model_config.vocab_size,
                              model_config.max_position_embeddings, args.seed)
    rank_us = {n: time_rank_groups(n) for n in (2, 64)}
    runs = run_both(args, requests, model_dir, model_config.vocab_size)
    summary = {router: summarize(run) for router, run in runs.items()}
    last_arrival = requests[-1].arrival_s
    meta = {
        "trace": str(args.trace), "trace_format": trace_format,
        "num_requests": len(requests), "model": model_dir.name, "dtype": "float32 on CPU"
        if engine_is_cpu() else "checkpoint dtype on CUDA", "tp": args.tp,
        "groups": args.groups, "kv_blocks": args.kv_blocks, "block_size": args.block_size,
        "prompt_scale": args.prompt_scale, "max_output": args.max_output,
        "arrival": args.arrival, "rate_req_s": args.rate if args.arrival == "poisson" else None,
        "time_scale": args.time_scale if args.arrival == "trace" else None,
        "arrival_desc": (f"Poisson {args.rate} req/s" if args.arrival == "poisson" else
                         f"trace times / {args.time_scale}") + f", last at {last_arrival:.1f} s",
        "workload_prompt_tokens": sum(len(r.prompt_ids) for r in requests),
        "workload_output_tokens": sum(r.max_tokens for r in requests),
        "router": router_figures(runs["kv"].router_stats, rank_us),
        "ttft_p99_kv_over_pow2": _ratio(summary["kv"]["ttft_p99_ms"],
                                        summary["pow2"]["ttft_p99_ms"]),
        "throughput_kv_over_pow2": _ratio(summary["kv"]["throughput_tok_s"],
                                          summary["pow2"]["throughput_tok_s"]),
    }
    out = flat_json(summary, meta)
    out["wall_s"] = round(time.perf_counter() - wall_start, 1)
    sys.stderr.flush()
    report(summary, meta)
    print(json.dumps(out), flush=True)
    return 0


def engine_is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TraceError, FileNotFoundError) as exc:
        print(f"bench_serve: {exc}", file=sys.stderr)
        sys.exit(2)
