"""Per-request changes to the logits before a token is chosen, batched over the rows that ask.

The order is ``transformers``' (so greedy outputs match its logits processors): ``logit_bias``,
``repetition_penalty`` (divides a positive logit, multiplies a negative one, for every token in
the prompt or the output), ``presence_penalty`` and ``frequency_penalty`` (subtract a constant
and a count-proportional amount for every token in the output, as OpenAI defines them), then
``min_tokens`` (EOS and stop tokens get -inf until enough tokens were generated).
Cost: O(rows asking x vocabulary) plus O(their token history) to build the index tensors.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from kv.host_staging import tensor_on
from workers.sampling_params import SamplingParams

History = Tuple[Sequence[int], Sequence[int]]  # (prompt token ids, output token ids)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[History], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """``logits`` ``[N, V]`` float, changed in place and returned."""
    _add_bias(logits, params)
    device = logits.device
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rows:
        seen = _token_counts(logits, rows, [list(histories[i][0]) + list(histories[i][1])
                                            for i in rows]) > 0
        penalty = _row_values(logits, [params[i].repetition_penalty for i in rows])
        index = tensor_on(rows, torch.long, device)
        scores = logits.index_select(0, index)
        penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
        logits.index_copy_(0, index, torch.where(seen, penalized, scores))
    rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if rows:
        counts = _token_counts(logits, rows, [histories[i][1] for i in rows])
        presence = _row_values(logits, [params[i].presence_penalty for i in rows])
        frequency = _row_values(logits, [params[i].frequency_penalty for i in rows])
        index = tensor_on(rows, torch.long, device)
        logits.index_copy_(0, index, logits.index_select(0, index)
                           - (frequency * counts + presence * (counts > 0)))
    held = [(row, t) for row, p in enumerate(params) if len(histories[row][1]) < p.min_tokens
            for t in (*eos_token_ids, *p.stop_token_ids) if t < logits.shape[-1]]
    if held:
        held_rows, held_ids = zip(*held)
        logits.index_put_((tensor_on(held_rows, torch.long, device),
                           tensor_on(held_ids, torch.long, device)),
                          logits.new_full((len(held),), float("-inf")))
    return logits


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    rows: List[int] = []
    cols: List[int] = []
    values: List[float] = []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            rows.append(row)
            cols.append(token)
            values.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((tensor_on(rows, torch.long, device),
                           tensor_on(cols, torch.long, device)),
                          tensor_on(values, logits.dtype, device), accumulate=True)


def _row_values(logits: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    """``values`` as a ``[M, 1]`` column on the logits' device."""
    return tensor_on(values, logits.dtype, logits.device)[:, None]


def _token_counts(logits: torch.Tensor, rows: Sequence[int],
                  token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """How often each vocabulary id occurs in each row's tokens: ``[M, V]``."""
    vocab = logits.shape[-1]
    width = max(1, max(len(t) for t in token_lists))
    # Padding points at an extra column that is cut off afterwards.
    padded = torch.full((len(rows), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        padded[i, :len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
    padded = padded.to(logits.device, non_blocking=True)
    counts = torch.zeros(len(rows), vocab + 1, device=logits.device, dtype=logits.dtype)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    return counts[:, :vocab]
