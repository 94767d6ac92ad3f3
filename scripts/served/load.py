"""A small load generator for an OpenAI-compatible server: streaming chat completions through the
official ``openai`` async client (real HTTP, server-sent events), a fixed number in flight.

Each request asks for exactly ``max_tokens`` tokens (``ignore_eos``, temperature 0) and for the
usage chunk at the end, whose ``completion_tokens`` is its output length (a chunk may carry
several tokens). Figures per request, as aiperf defines them: TTFT is send to the first chunk
with content; ITL is (last content chunk - first content chunk) / (output tokens - 1), so a
server that sends several tokens in one chunk is timed per token all the same.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float
    latency_s: float
    num_output_tokens: int
    num_prompt_tokens: int
    error: Optional[str] = None
    num_chunks: int = 0  # stream chunks that carried content

    @property
    def itl_s(self) -> Optional[float]:
        """Mean time between output tokens after the first (None for one token or fewer)."""
        if self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class LoadResult:
    """One run: every request's result and the wall time from first send to last response."""

    results: List[RequestResult]
    wall_s: float

    @property
    def ok(self) -> List[RequestResult]:
        return [r for r in self.results if r.error is None]

    def figures(self) -> dict:
        """Output tok/s, TTFT p50/p99 and ITL p50 (seconds) of the successful requests."""
        ok = self.ok
        ttfts = [r.ttft_s for r in ok]
        itls = [r.itl_s for r in ok if r.itl_s is not None]
        return {"output_tok_s": sum(r.num_output_tokens for r in ok) / self.wall_s,
                "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
                "itl_p50_s": percentile(itls, 50),
                "tokens_per_chunk": sum(r.num_output_tokens for r in ok)
                / max(1, sum(r.num_chunks for r in ok)),
                "num_requests": len(self.results), "num_failed": len(self.results) - len(ok),
                "mean_prompt_tokens": statistics.fmean(r.num_prompt_tokens for r in ok)
                if ok else None,
                "wall_s": self.wall_s}


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile, linearly interpolated (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def one_request(client, model: str, content: str, max_tokens: int) -> RequestResult:
    """One streamed chat completion, timed."""
    started = time.perf_counter()
    first = last = None
    num_output = num_prompt = num_chunks = 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
                num_chunks += 1
            if chunk.usage is not None:
                num_output, num_prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        return RequestResult(0.0, 0.0, 0, 0, f"{type(exc).__name__}: {exc}")
    if first is None or num_output == 0:
        return RequestResult(0.0, 0.0, 0, 0, "no content or no usage chunk in the stream")
    return RequestResult(first - started, last - started, num_output, num_prompt, None,
                         num_chunks)


async def run_load(base_url: str, model: str, contents: Sequence[str], max_tokens: int,
                   concurrency: int, timeout_s: float = 600.0) -> LoadResult:
    """Send every prompt in ``contents``, at most ``concurrency`` in flight (a closed loop: the
    next is sent as one ends)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", timeout=timeout_s,
                                max_retries=0)
    slots = asyncio.Semaphore(concurrency)

    async def bounded(content: str) -> RequestResult:
        async with slots:
            return await one_request(client, model, content, max_tokens)

    try:
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(c) for c in contents))
        wall_s = time.perf_counter() - started
    finally:
        await client.close()
    return LoadResult(list(results), wall_s)
