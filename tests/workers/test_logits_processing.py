"""Logit processing and the batched filters against their definitions and ``transformers``'
own processors on the same logits."""

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from workers.logits_processing import process_logits
from workers.sampler import _draw, _top_k_top_p, sample
from workers.sampling_params import SamplingParams


def logits(rows=3, vocab=40, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_presence_and_frequency_penalties_follow_openai():
    raw = logits(1)
    out_ids = [3, 3, 3, 7]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = process_logits(raw.clone(), [p], [([1, 2], out_ids)], ())
    expected = raw.clone()
    expected[0, 3] -= 3 * 0.25 + 0.5
    expected[0, 7] -= 1 * 0.25 + 0.5
    assert torch.allclose(got, expected)  # prompt tokens 1, 2 are not penalized


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    raw = logits(2)
    histories = [([1, 2, 5], [9, 9]), ([4], [])]
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6)]
    got = process_logits(raw.clone(), params, histories, ())
    for row, (p, (prompt, output)) in enumerate(zip(params, histories)):
        ids = torch.tensor([prompt + output])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, raw[row:row + 1])
        assert torch.allclose(got[row], want[0])


def test_min_tokens_holds_eos_and_stop_tokens_back_only_until_reached():
    raw = logits(2)
    p = SamplingParams(min_tokens=2, stop_token_ids=(11,))
    got = process_logits(raw.clone(), [p, p], [([1], [5]), ([1], [5, 6])], eos_token_ids=(2,))
    assert got[0, 2] == float("-inf") and got[0, 11] == float("-inf")
    assert torch.equal(got[1], raw[1])


def test_rows_without_processing_are_untouched_and_bias_adds():
    raw = logits(2)
    params = [SamplingParams(), SamplingParams(logit_bias={4: 2.5, 9: -100.0})]
    got = process_logits(raw.clone(), params, [((), ()), ((), ())], ())
    assert torch.equal(got[0], raw[0])
    assert torch.isclose(got[1, 4], raw[1, 4] + 2.5) and torch.isclose(got[1, 9], raw[1, 9] - 100)


def test_batched_filters_equal_transformers_warpers_per_row():
    raw = logits(4, 60)
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.6),
              SamplingParams(temperature=1.0, top_k=10, top_p=0.8), SamplingParams(min_p=0.2)]
    ids = torch.zeros(1, 1, dtype=torch.long)
    for row, p in enumerate(params):
        want = TemperatureLogitsWarper(p.temperature)(ids, raw[row:row + 1])
        if p.top_k:
            want = TopKLogitsWarper(p.top_k)(ids, want)
        if p.top_p < 1:
            want = TopPLogitsWarper(p.top_p)(ids, want)
        if p.min_p:
            want = MinPLogitsWarper(p.min_p)(ids, want)
        kept = torch.isfinite(want[0])
        scaled = raw[row:row + 1] / p.temperature
        if p.top_k or p.top_p < 1:
            scaled = _top_k_top_p(scaled, [p])
        if p.min_p:
            probs = scaled.softmax(-1)
            scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        assert torch.equal(torch.isfinite(scaled[0]), kept), row
        draws = {int(_draw(raw[row:row + 1], [p], [torch.Generator().manual_seed(s)])[0])
                 for s in range(100)}
        assert draws <= set(kept.nonzero()[:, 0].tolist())


def test_sampling_without_histories_is_refused_when_needed():
    import pytest

    with pytest.raises(ValueError, match="history"):
        sample(logits(1), [SamplingParams(repetition_penalty=1.2)], [torch.Generator()])
