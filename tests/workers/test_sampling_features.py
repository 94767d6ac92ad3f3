"""The sampling features a vLLM user expects, through the real engine on a tiny checkpoint:
greedy parity with ``transformers`` where its ``generate`` has the same feature (repetition
penalty, min new tokens, logit bias as a sequence bias), ``n`` choices sharing one prefill,
seeded choices reproducible whatever else runs."""

import pytest

from tiny_models import hf_greedy
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
EOS = 2  # the tiny checkpoints' eos_token_id


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=128,
                                 dtype="float32")) as e:
        yield e


def run(engine, prompts, params):
    """Every choice's output ids, by (prompt index, choice index)."""
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[ids[out.request_id], out.index] = out
    return final


def test_repetition_penalty_equals_transformers(engine, tiny_llama):
    params = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=0.4,
                            ignore_eos=True)
    got = run(engine, PROMPTS, params)
    expected = hf_greedy(tiny_llama, PROMPTS, 12, repetition_penalty=0.4)
    plain = hf_greedy(tiny_llama, PROMPTS, 12)
    assert expected != plain  # the penalty changes this model's output: the test can fail
    assert [got[i, 0].output_token_ids for i in range(2)] == expected


def test_logit_bias_and_min_tokens_equal_transformers(engine, tiny_llama):
    """A bias that makes EOS the likeliest token, held back for min_tokens tokens."""
    params = SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 50.0}, min_tokens=4)
    got = run(engine, PROMPTS, params)
    expected = hf_greedy(tiny_llama, PROMPTS, 10, sequence_bias={(EOS,): 50.0},
                         min_new_tokens=4, eos_token_id=EOS)
    for i in range(2):
        assert got[i, 0].output_token_ids == expected[i]
        assert len(expected[i]) == 5 and expected[i][-1] == EOS
        assert got[i, 0].finish_reason == "stop"


def test_n_greedy_choices_share_one_prefill(engine, tiny_llama):
    kv = engine.scheduler.kv
    hits_before = kv.num_device_hits
    got = run(engine, [PROMPTS[0]], SamplingParams(n=3, max_tokens=6, temperature=0,
                                                   ignore_eos=True))
    [expected] = hf_greedy(tiny_llama, [PROMPTS[0]], 6)
    assert [got[0, i].output_token_ids for i in range(3)] == [expected] * 3
    # Choices 1 and 2 found the 2 full blocks (8 tokens) that choice 0 computed.
    assert kv.num_device_hits - hits_before >= 2 * 8


def test_seeded_choices_are_reproducible_in_any_batch(engine):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.5, seed=1234, ignore_eos=True)
    alone = run(engine, [PROMPTS[0]], params)
    busy = run(engine, [PROMPTS[1], PROMPTS[0], PROMPTS[1]], params)
    choices = [alone[0, i].output_token_ids for i in range(3)]
    assert [busy[1, i].output_token_ids for i in range(3)] == choices
    assert len({tuple(c) for c in choices}) > 1  # each choice has its own seed
    single = run(engine, [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=1.5,
                                                      seed=1235, ignore_eos=True))
    assert single[0, 0].output_token_ids == choices[1]  # choice i draws from seed + i


def test_abort_finishes_every_choice(engine):
    rid = engine.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    outs = [o for o in engine.step() if o.request_id == rid]
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (1, "abort")]
    assert not engine.has_unfinished()


def test_bad_token_ids_in_params_are_refused(engine):
    with pytest.raises(ValueError, match="logit_bias: token ids must be in"):
        engine.add_request(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))


def test_stop_strings_do_not_end_a_request_before_min_tokens(engine):
    """As vLLM: a stop string counts only once more than ``min_tokens`` tokens were generated."""
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)
    whole = run(engine, [PROMPTS[0]], SamplingParams(**greedy))[0, 0]
    stop = whole.text[:2]  # ends inside the first token or two
    early = run(engine, [PROMPTS[0]], SamplingParams(stop=(stop,), **greedy))[0, 0]
    assert early.finish_reason == "stop" and len(early.output_token_ids) <= 2
    held = run(engine, [PROMPTS[0]], SamplingParams(stop=(stop,), min_tokens=4, **greedy))[0, 0]
    assert len(held.output_token_ids) > 4
    assert held.text.startswith(stop)  # the early stop string is ordinary text
