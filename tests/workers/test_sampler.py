"""The sampler: greedy, filters, seeded draws, logprobs; SamplingParams validation."""

import math

import pytest
import torch

from workers.sampler import first_max, sample, sample_on_device
from workers.sampling_params import SamplingParams


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 1.0, 4.9]])
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2, [gen(), gen()])
    assert [t.token_id for t in out] == [1, 0]


def test_greedy_rows_of_bf16_logits_take_the_first_maximum_as_in_fp32():
    # bf16 has few values: rows with tied maxima, where the first one must win in any dtype.
    logits = (torch.randn(64, 300, generator=gen(1)) * 4).round().to(torch.bfloat16)
    greedy = [SamplingParams(temperature=0.0)] * 64
    ids = [t.token_id for t in sample(logits, greedy, [gen()] * 64)]
    assert ids == logits.float().argmax(-1).tolist()
    with_logprobs = [SamplingParams(temperature=0.0, logprobs=0)] * 64  # through fp32
    assert [t.token_id for t in sample(logits, with_logprobs, [gen()] * 64)] == ids


def test_the_static_paths_first_maximum_into_buffers_is_the_first_maximum():
    logits = (torch.randn(6, 300, generator=gen(2)) * 4).round().to(torch.bfloat16)  # ties
    values, ids = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.long)
    assert first_max(logits, out=(values[:6], ids[:6])).data_ptr() == ids.data_ptr()
    assert ids[:6].tolist() == logits.float().argmax(-1).tolist()


def test_greedy_ids_given_are_the_tokens_of_a_plain_greedy_step_alone():
    """The decode graph's ids are the tokens when every row is greedy without logprobs,
    processing or a mask; any other step samples from the logits."""
    logits = torch.randn(3, 50, generator=gen(3))
    given = torch.tensor([7, 8, 9])  # not the argmax: which path answered shows
    greedy = [SamplingParams(temperature=0.0)] * 3
    assert sample_on_device(logits, greedy, [gen()] * 3, greedy_ids=given).tokens is given
    others = [[SamplingParams(temperature=0.0, logprobs=1)] * 3,
              greedy[:2] + [SamplingParams(temperature=0.8, seed=1)],
              [SamplingParams(temperature=0.0, repetition_penalty=1.0001)] * 3]
    for params in others:
        tokens = sample_on_device(logits, params, [gen()] * 3, [((1,), ())] * 3,
                                  greedy_ids=given).tokens
        assert tokens[:2].tolist() == first_max(logits)[:2].tolist(), params


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature():
    logits = torch.randn(4, 50, generator=gen(3))
    for params in (SamplingParams(temperature=5.0, top_k=1),
                   SamplingParams(temperature=5.0, top_p=1e-6)):
        out = sample(logits, [params] * 4, [gen(i) for i in range(4)])
        assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_top_k_never_draws_outside_the_top_k():
    logits = torch.arange(10, dtype=torch.float32)[None]
    params = SamplingParams(temperature=10.0, top_k=3)
    draws = {sample(logits, [params], [gen(s)])[0].token_id for s in range(200)}
    assert draws == {7, 8, 9}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = SamplingParams(temperature=1.0, top_p=0.75)  # 0.5 + 0.3 reaches it
    draws = {sample(probs.log(), [params], [gen(s)])[0].token_id for s in range(300)}
    assert draws == {0, 1}


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = gen(1)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(probs.log()[None], [SamplingParams()], [g])[0].token_id] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_same_seed_same_tokens():
    logits = torch.randn(1, 1000, generator=gen(5))

    def draws(seed):
        g = gen(seed)
        return [sample(logits, [SamplingParams()], [g])[0].token_id for _ in range(8)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)


def test_a_shared_generator_draws_once_for_its_rows_and_a_seeded_row_alone():
    # Unseeded rows share the engine's generator: one [k, V] draw for them all, not k launches.
    # A seeded row draws its V values from its own generator, as it would alone in the batch.
    from workers.sampler import _race

    shared, seeded = gen(7), gen(99)
    race = _race([shared, seeded, shared, shared], 50, torch.device("cpu"))
    together = torch.empty(3, 50).exponential_(generator=gen(7))
    alone = torch.empty(1, 50).exponential_(generator=gen(99))
    assert torch.equal(race[[0, 2, 3]], together) and torch.equal(race[1], alone[0])


def test_a_seeded_row_samples_the_same_token_whatever_the_batch():
    logits = torch.randn(4, 300, generator=gen(3))
    params = [SamplingParams(temperature=1.0)] * 4
    alone = sample(logits[1:2], params[:1], [gen(1234)])[0].token_id
    batch = sample(logits, params, [gen(1), gen(1234), gen(1), gen(2)])
    assert batch[1].token_id == alone


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2)], [gen()])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert out.token_id == 2 and math.isclose(out.logprob, expected[2].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs] == [2, 1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"), (dict(logprobs=21), "logprobs"),
    (dict(stop=("",)), "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
