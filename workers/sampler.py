"""Turns rank 0's logits into next tokens for the whole step at once.

1. Logit processing, for the rows that ask for it (``logits_processing``): bias, penalties,
   ``min_tokens``; then the grammar masks of constrained rows (`workers.structured`).
2. Greedy rows take the argmax (in a step of greedy rows alone, the one a decode graph computed
   with the logits, when it did); sampled rows are scaled by their temperature, filtered by
   top-k / top-p / min-p (one sort for the rows that need it) and drawn by an exponential race:
   ``argmax(p / q)`` with ``q ~ Exp(1)`` drawn from the row's own generator, which picks token i
   with probability ``p_i`` and keeps a seeded request's draws independent of its batch.
3. The sampled ids (and the logprobs asked for) stay on the device (``sample_on_device``) until
   the host reads them (``read_samples``; `workers.sample_copy` copies them without blocking);
   the per-row parameters go to the device through pinned memory, without a host sync.

Cost: O(rows x vocabulary) on the logits' device, plus O(history) for rows with penalties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from kv.host_staging import tensor_on
from workers.logits_processing import History, process_logits
from workers.models.cpu_layer_kernels import layer_kernels
from workers.sampling_params import SamplingParams
from workers.structured.matcher import TokenMask


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Tuple[Tuple[int, float], ...] = ()


@dataclass(frozen=True)
class DeviceSamples:
    """A step's sampled ids, and the logprobs its rows asked for, where they were computed (the
    logits' device); ``read_samples`` turns them into ``SampledToken``s on the host."""

    tokens: torch.Tensor  # [N] int64
    params: Tuple[SamplingParams, ...]
    chosen: Optional[torch.Tensor] = None  # [N] float32: log-probability of each sampled id
    top_values: Optional[torch.Tensor] = None  # [N, k] float32: the k most likely, descending
    top_ids: Optional[torch.Tensor] = None  # [N, k] int64

    def map(self, fn) -> "DeviceSamples":
        """The same samples with ``fn`` applied to each tensor (e.g. a copy to the host)."""
        return DeviceSamples(fn(self.tokens), self.params,
                             *(None if t is None else fn(t)
                               for t in (self.chosen, self.top_values, self.top_ids)))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator],
           histories: Optional[Sequence[History]] = None,
           eos_token_ids: Sequence[int] = (),
           mask: Optional[TokenMask] = None) -> List[SampledToken]:
    """``sample_on_device``, read on the host at once (which waits for the device)."""
    return read_samples(sample_on_device(logits, params, generators, histories, eos_token_ids,
                                         mask))


def sample_on_device(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator],
                     histories: Optional[Sequence[History]] = None,
                     eos_token_ids: Sequence[int] = (),
                     mask: Optional[TokenMask] = None,
                     greedy_ids: Optional[torch.Tensor] = None) -> DeviceSamples:
    """One token per row of ``logits`` ``[N, V]``, row i drawn with ``generators[i]`` (on the
    logits' device), left on that device: nothing here waits for it. ``histories[i]`` (prompt
    ids, output ids) is needed by rows with penalties or ``min_tokens``; ``eos_token_ids`` are
    what ``min_tokens`` holds back. ``mask``: the tokens each constrained row may take, applied
    after logit processing and before greedy or random choice (logprobs stay those of the raw
    logits). ``greedy_ids`` ``[N]``: ``first_max(logits)`` computed already (by a decode graph);
    a step of greedy rows alone, unmasked and unprocessed, returns them as its tokens (the same
    tensor: `workers.step_logits` says how long it stays valid)."""
    if mask is None and all(p.is_greedy and p.logprobs is None and not p.processes_logits
                            for p in params):
        # Widening to fp32 keeps every value and so the first maximum: no copy needed.
        tokens = first_max(logits) if greedy_ids is None else greedy_ids
        return DeviceSamples(tokens, tuple(params))
    raw = logits.float()
    logits = raw
    if any(p.processes_logits for p in params):
        if histories is None:
            raise ValueError("penalties and min_tokens need each row's token history")
        logits = process_logits(raw.clone(), params, histories, eos_token_ids)
    if mask is not None:
        if logits is raw and any(p.logprobs is not None for p in params):
            logits = raw.clone()
        mask.apply(logits)
    tokens = first_max(logits)  # [N]
    drawn_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if drawn_rows:
        rows = tensor_on(drawn_rows, torch.long, logits.device)
        drawn = _draw(logits[rows], [params[i] for i in drawn_rows],
                      [generators[i] for i in drawn_rows])
        tokens = tokens.index_copy(0, rows, drawn)
    if all(p.logprobs is None for p in params):
        return DeviceSamples(tokens, tuple(params))
    return _with_logprobs(raw, tokens, params)


def read_samples(samples: DeviceSamples) -> List[SampledToken]:
    """``samples`` as tokens on the host (a copy from the device, which waits for it, unless the
    tensors are on the host already)."""
    token_ids = samples.tokens.tolist()
    if samples.chosen is None:
        return [SampledToken(t) for t in token_ids]
    chosen = samples.chosen.tolist()
    tops: List[List[Tuple[int, float]]] = [[] for _ in token_ids]
    if samples.top_ids is not None and samples.top_values is not None:
        tops = [list(zip(i, v)) for i, v in zip(samples.top_ids.tolist(),
                                                samples.top_values.tolist())]
    return [SampledToken(token) if p.logprobs is None
            else SampledToken(token, chosen[row], tuple(tops[row][:p.logprobs]))
            for row, (token, p) in enumerate(zip(token_ids, samples.params))]


def first_max(rows: torch.Tensor,
              out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The index of each row's first maximum, ``argmax``'s answer, as ``max``'s indices (a
    cheaper kernel than ``argmax``'s on CPU; bf16 rows on CPU go through the C kernel of
    `workers.models.cpu_layer_kernels`, where it runs). ``out``: the (values, indices) tensors
    ``max`` writes, in ``rows``' dtype and int64 (a decode graph's static buffers); indices
    returned."""
    if out is None:
        if rows.dtype == torch.bfloat16 and rows.device.type == "cpu" and rows.dim() == 2:
            kernels = layer_kernels()
            if kernels is not None:
                return kernels.first_max(rows)
        return rows.max(dim=-1).indices
    return torch.max(rows, dim=-1, out=out).indices


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Sampled ids ``[M]`` of rows ``logits`` ``[M, V]`` (temperatures > 0)."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = tensor_on([p.temperature for p in params], torch.float32, device)
    logits = logits / temperature[:, None]
    if any(p.top_k is not None or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    if any(p.min_p > 0.0 for p in params):
        min_p = tensor_on([p.min_p for p in params], torch.float32, device)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True),
                                    float("-inf"))
    probs = logits.softmax(-1)
    return first_max(probs / _race(generators, vocab, device).clamp_min_(1e-20))


def _race(generators: Sequence[torch.Generator], vocab: int,
          device: torch.device) -> torch.Tensor:
    """``[M, V]`` Exp(1) draws, row i from ``generators[i]``. Rows that share a generator (every
    unseeded request shares the engine's) take one draw for all of them: one launch, not one per
    row. A seeded row has a generator of its own and draws exactly its ``V`` values, so its
    tokens do not depend on the rest of the batch."""
    groups: Dict[int, Tuple[torch.Generator, List[int]]] = {}
    for row, generator in enumerate(generators):
        groups.setdefault(id(generator), (generator, []))[1].append(row)
    rows: List[Optional[torch.Tensor]] = [None] * len(generators)
    for generator, members in groups.values():
        drawn = torch.empty(len(members), vocab, device=device).exponential_(generator=generator)
        for row, values in zip(members, drawn):
            rows[row] = values
    return torch.stack(rows)  # type: ignore[arg-type]


def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) each row's tokens outside its top-k and outside its top-p nucleus."""
    device, vocab = logits.device, logits.shape[-1]
    top_k = tensor_on([min(p.top_k or vocab, vocab) for p in params], torch.long, device)
    top_p = tensor_on([p.top_p for p in params], torch.float32, device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [M, V]
    rank = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Drop a token when the tokens before it already reach top_p (the first always stays).
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return logits.scatter(1, order, sorted_logits)


def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                   params: Sequence[SamplingParams]) -> DeviceSamples:
    """Log-probabilities of the raw model output (before any processing), as vLLM returns."""
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = max(p.logprobs or 0 for p in params)
    if not k:
        return DeviceSamples(tokens, tuple(params), chosen)
    values, ids = logprobs.topk(k, dim=-1)
    return DeviceSamples(tokens, tuple(params), chosen, values, ids)
