"""Synthetic Mooncake-format workloads for ``bench_kv_tiers.py`` (rows of ``traces.TraceRequest``).

``hot_prompts``: where a frequency-aware eviction policy should beat LRU. ``num_prompts`` shared
system prompts of ``prompt_blocks`` blocks each, picked per request with Zipf(``zipf_s``)
popularity, each followed by a one-off document of ``doc_blocks`` blocks that no other request
shares. Between two uses of a lukewarm prompt, many requests' documents flow through every tier;
once they outnumber a tier's blocks, LRU has evicted the prompt by the time it comes back, while
a decayed-frequency score keeps the prompts (used again and again) above the documents (used
once)::

    request i:  [ prompt p_i: prompt_blocks ][ document i: doc_blocks, never seen again ]
                 p_i ~ Zipf(s) over num_prompts

``no_reuse``: the same shape with nothing shared (every block one-off): whatever the tiers cost
here is pure overhead, since nothing they keep is ever asked for again.

Hash ids: prompt ``p`` block ``j`` is ``p * prompt_blocks + j``; documents take ids after every
prompt block, so no two documents share one.
"""

from __future__ import annotations

import random
from typing import List

from scripts.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

WORKLOADS = ("trace", "hot_prompts", "no_reuse")


def hot_prompts(num_requests: int, num_prompts: int = 24, prompt_blocks: int = 16,
                doc_blocks: int = 12, output_tokens: int = 4, zipf_s: float = 1.0,
                seed: int = 0) -> List[TraceRequest]:
    """The rows of the hot-prompts workload (see the module docstring), one a second."""
    if min(num_requests, num_prompts, prompt_blocks, doc_blocks, output_tokens) < 1:
        raise ValueError("hot_prompts: every count must be at least 1")
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(num_prompts)]
    next_id = num_prompts * prompt_blocks
    rows = []
    for index in range(num_requests):
        prompt = rng.choices(range(num_prompts), weights)[0]
        ids = list(range(prompt * prompt_blocks, (prompt + 1) * prompt_blocks))
        ids += range(next_id, next_id + doc_blocks)
        next_id += doc_blocks
        rows.append(TraceRequest(float(index), len(ids) * MOONCAKE_BLOCK_TOKENS, output_tokens,
                                 tuple(ids)))
    return rows


def no_reuse(num_requests: int, num_blocks: int = 32, output_tokens: int = 4
             ) -> List[TraceRequest]:
    """``num_requests`` prompts of ``num_blocks`` blocks, no block in two of them."""
    if min(num_requests, num_blocks, output_tokens) < 1:
        raise ValueError("no_reuse: every count must be at least 1")
    return [TraceRequest(float(i), num_blocks * MOONCAKE_BLOCK_TOKENS, output_tokens,
                         tuple(range(i * num_blocks, (i + 1) * num_blocks)))
            for i in range(num_requests)]
