"""Turns rank 0's logits into next tokens: greedy, or temperature / top-k / top-p sampling with
a per-request generator (a seeded request draws the same tokens in any batch), plus logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from workers.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Tuple[Tuple[int, float], ...] = ()


def _filter_top_k_top_p(logits: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and outside the top-p nucleus. ``logits``: [V]."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator]) -> List[SampledToken]:
    """One token per row of ``logits`` ``[N, V]``, row i drawn with ``generators[i]``."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out = []
    for row, (p, gen) in enumerate(zip(params, generators)):
        token = greedy[row]
        if not p.is_greedy:
            scaled = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
            token = int(torch.multinomial(scaled.softmax(-1), 1, generator=gen).item())
        out.append(_with_logprobs(token, p, logprobs[row] if logprobs is not None else None))
    return out


def _with_logprobs(token: int, params: SamplingParams,
                   logprobs: Optional[torch.Tensor]) -> SampledToken:
    if logprobs is None or params.logprobs is None:
        return SampledToken(token)
    top: Tuple[Tuple[int, float], ...] = ()
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return SampledToken(token, float(logprobs[token]), top)
