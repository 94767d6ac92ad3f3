"""One replay of the serving benchmark's requests against an OpenAI endpoint, and what the groups'
``/metrics`` say meanwhile (``scripts/bench_serve.py`` describes the run).

Per request: TTFT (request sent to the first streamed token), inter-token latencies (the gaps
between streamed chunks that carry tokens; ``logprobs=0`` is requested so every token shows up in
the stream even when its text is held back), end-to-end latency. Every second the ingress's
``/metrics`` is read: each group's KV usage (its peak and mean over the samples) and counters
(preemptions, prefix-cache queries and hits).
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from scripts.serve.workload import BenchRequest

METRICS_SAMPLE_PERIOD_S = 1.0


def log(message: str) -> None:
    print(f"bench_serve: {message}", file=sys.stderr, flush=True)


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
    kv_usage_sum: Dict[str, float] = field(default_factory=dict)  # by group, over the samples
    kv_usage_samples: Dict[str, int] = field(default_factory=dict)
    group_counters: Dict[str, Dict[str, float]] = field(default_factory=dict)  # group -> name
    router_stats: Optional[Dict[str, Any]] = None
    other_cpu_frac: Optional[float] = None  # of the machine, used by processes not ours
    load_avg: List[Optional[float]] = field(default_factory=list)  # 1-min: start, end


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
    """Every second: each group's KV usage (its peak and sum) and counters, from /metrics."""
    url = base_url.rsplit("/v1", 1)[0] + "/metrics"
    while True:
        try:
            text = await asyncio.to_thread(_get_text, url)
            usage, counters = parse_group_metrics(text)
            for group, value in usage.items():
                run.kv_usage_peak[group] = max(value, run.kv_usage_peak.get(group, 0.0))
                run.kv_usage_sum[group] = run.kv_usage_sum.get(group, 0.0) + value
                run.kv_usage_samples[group] = run.kv_usage_samples.get(group, 0) + 1
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


def add_counts(into: Dict[str, int], counts: Dict[str, int]) -> Dict[str, int]:
    """Adds ``counts`` into ``into`` key by key; returns ``into``."""
    for key, n in counts.items():
        into[key] = into.get(key, 0) + n
    return into
