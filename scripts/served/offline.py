"""The offline engine under the served load: the same token ids through ``LLMEngine`` in this
process, ``concurrency`` requests in flight (a closed loop, as the load generator keeps: a new
request is added as soon as one finishes), greedy, exactly ``max_tokens`` tokens each."""

from __future__ import annotations

import time
from collections import deque
from typing import Dict, List, Sequence

from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams


def build_offline(model_dir: str, dtype: str = "auto") -> LLM:
    """The engine as ``tpserve serve`` builds a group's (its defaults), warmed up."""
    llm = LLM(EngineConfig(model=model_dir, dtype=dtype))
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return llm


def run_offline(llm: LLM, prompt_ids: Sequence[Sequence[int]], max_tokens: int,
                concurrency: int) -> Dict[str, float]:
    """Output tok/s, and TTFT / ITL measured as the load generator does (per request: first
    token after its add; ITL over its later tokens)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = deque(prompt_ids)
    added: Dict[str, float] = {}
    first: Dict[str, float] = {}
    done: List[tuple] = []

    def add_next() -> None:
        added[engine.add_request(list(pending.popleft()), params)] = time.perf_counter()

    started = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        add_next()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                rid = out.request_id
                done.append((first[rid] - added[rid], now - added[rid],
                             len(out.output_token_ids)))
                if pending:
                    add_next()
    wall_s = time.perf_counter() - started
    return offline_figures(done, wall_s)


def offline_figures(done: Sequence[tuple], wall_s: float) -> Dict[str, float]:
    from scripts.served.load import LoadResult, RequestResult

    results = [RequestResult(ttft, latency, n, 0) for ttft, latency, n in done]
    figures = LoadResult(results, wall_s).figures()
    figures.pop("mean_prompt_tokens")
    figures.pop("tokens_per_chunk")  # no stream chunks offline
    return figures
