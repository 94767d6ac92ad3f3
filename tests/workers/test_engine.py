"""Engine behaviour on a tiny real checkpoint: streaming, stops, abort, limits, sampling."""

import pytest

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.llm import LLM
from workers.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=128))
    yield eng
    eng.shutdown()


def run(engine, prompt, **params):
    rid = engine.add_request(prompt, SamplingParams(**params))
    stream = []
    while engine.has_unfinished():
        stream.extend(o for o in engine.step() if o.request_id == rid)
    return stream


def test_stream_deltas_add_up_to_the_final_text(engine):
    stream = run(engine, "the quick brown fox", max_tokens=12, **GREEDY)
    final = stream[-1]
    assert final.finished and final.finish_reason == "length"
    assert len(final.output_token_ids) == 12
    assert "".join(o.delta_text for o in stream) == final.text
    assert [t for o in stream for t in o.new_token_ids] == final.output_token_ids
    assert final.text == engine.tokenizer.decode(final.output_token_ids, skip_special_tokens=True)


def test_stop_token_ends_the_request_with_it_included(engine):
    full = run(engine, [5, 6, 7], max_tokens=10, **GREEDY)[-1].output_token_ids
    stop_at = full[4]
    out = run(engine, [5, 6, 7], max_tokens=10, stop_token_ids=(stop_at,), **GREEDY)[-1]
    assert out.finish_reason == "stop"
    assert out.output_token_ids == full[:full.index(stop_at) + 1]


def test_stop_string_truncates_the_text(engine):
    full = run(engine, "hello world", max_tokens=40, **GREEDY)[-1]
    printable = [i for i in range(len(full.text) - 2) if full.text[i:i + 3].isprintable()]
    stop = full.text[printable[1]:printable[1] + 3]  # not at the very start
    out = run(engine, "hello world", max_tokens=40, stop=(stop,), **GREEDY)[-1]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.find(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(tiny_llama):
    # Make every token an EOS for this engine: the first sampled token ends the request.
    with LLM(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64)) as llm:
        first = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=5, **GREEDY))[0]
        llm.engine.model_config = llm.engine.model_config.__class__(
            **{**llm.engine.model_config.__dict__, "eos_token_ids": (first.output_token_ids[0],)})
        stopped = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=5, **GREEDY))[0]
        ignored = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=5, ignore_eos=True,
                                                           **GREEDY))[0]
    assert stopped.finish_reason == "stop" and len(stopped.output_token_ids) == 1
    assert ignored.output_token_ids == first.output_token_ids


def test_abort_finishes_the_request_and_frees_its_blocks(engine):
    rid = engine.add_request([3] * 20, SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.kv_usage().num_used_blocks > 0
    engine.abort(rid)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
    assert engine.kv_usage().num_used_blocks == 0
    assert not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    alone = run(engine, [11, 12, 13], **params.__dict__)[-1].output_token_ids
    ids = [engine.add_request([11, 12, 13], params),
           engine.add_request([40, 41], SamplingParams(max_tokens=8, temperature=1.0))]
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals[ids[0]].output_token_ids == alone


def test_logprobs_are_returned_per_token(engine):
    out = run(engine, [20, 21], max_tokens=3, logprobs=2, **GREEDY)[-1]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.output_token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0][0] == tok  # greedy: top-1


def test_prompt_longer_than_the_context_is_rejected(engine):
    with pytest.raises(ValueError, match="prompt has 300 tokens; the model's context is 256"):
        engine.add_request([3] * 300, SamplingParams())


@pytest.mark.parametrize("prompt,match", [([], "empty"), ([3, 9999], r"integers in \[0, 509\)")])
def test_bad_prompts_are_rejected(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, SamplingParams())


# The tiny model's KV block of 4 tokens in fp32: 2 layers x (K, V) x 4 tokens x 2 heads x 16 x
# 4 bytes.
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


@pytest.mark.parametrize("pool, flag", [(dict(num_kv_blocks=4), "--kv-blocks"),
                                        (dict(kv_cache_gb=4.5 * BLOCK_BYTES / 2**30),
                                         "--kv-cache-gb")])
def test_a_pool_smaller_than_the_models_context_lowers_it(tiny_llama, caplog, pool, flag):
    with caplog.at_level("WARNING", logger="workers.engine"):
        llm = LLM(EngineConfig(model=str(tiny_llama), block_size=4, dtype="float32", **pool))
    with llm:
        assert llm.engine.max_model_len == 16  # 4 blocks of 4 tokens, not the model's 256
        assert "lowered to 16" in caplog.text and "256" in caplog.text and flag in caplog.text
        with pytest.raises(ValueError, match="prompt has 20 tokens; the model's context is 16"):
            llm.engine.add_request([3] * 20, SamplingParams())
        out = llm.generate([[4] * 6], SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY))
    assert out[0].finish_reason == "length" and len(out[0].output_token_ids) == 10


@pytest.mark.parametrize("pool, flag", [(dict(num_kv_blocks=4), "--kv-blocks 4"),
                                        (dict(kv_cache_gb=4.5 * BLOCK_BYTES / 2**30),
                                         "--kv-cache-gb")])
def test_an_explicit_context_larger_than_the_pool_is_refused(tiny_llama, pool, flag):
    config = EngineConfig(model=str(tiny_llama), block_size=4, max_model_len=32, dtype="float32",
                          **pool)
    with pytest.raises(ValueError) as error:
        LLMEngine(config)
    message = str(error.value)
    assert "--max-model-len 32" in message and "16 tokens" in message and flag in message
    assert "--kv-blocks to at least 8" in message and "--max-model-len to at most 16" in message


def test_a_pool_for_one_full_sequence_but_not_two_preempts_without_deadlock(tiny_llama):
    params = SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)
    prompts = [[4] * 6, [5] * 6, [6] * 7]
    with LLM(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=4,
                          max_model_len=16)) as llm:
        alone = [llm.generate([p], params)[0].output_token_ids for p in prompts]
        together = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.output_token_ids for o in together] == alone
    assert all(o.finish_reason == "length" and len(o.output_token_ids) == 16 - len(p)
               for o, p in zip(together, prompts))


def test_context_limit_ends_generation(tiny_llama):
    with LLM(EngineConfig(model=str(tiny_llama), block_size=4, max_model_len=12)) as llm:
        out = llm.generate([[3] * 8], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 4


def test_kv_waste_is_the_unfilled_tail_of_each_request(engine):
    engine.add_request([7] * 10, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    engine.step()
    usage = engine.kv_usage()  # 10 tokens in 3 blocks of 4: 2 empty slots of 12
    assert usage.num_allocated_slots == 12 and usage.num_filled_slots == 10
    while engine.has_unfinished():
        engine.step()


def test_step_records_are_kept_only_when_asked_for(engine, tiny_llama):
    run(engine, [5, 6, 7], max_tokens=4, **GREEDY)
    assert engine.step_records == []  # a serving engine must not grow a list every step
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=16, record_steps=True)
    with LLM(config) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))
        records = llm.engine.step_records
    assert [r.num_tokens for r in records] == [3, 1, 1, 1]  # the prefill, then 3 decodes


def _stop_across_a_token_boundary(engine, token_ids, text):
    """A two-character stop string whose first character ends one token and whose second starts
    the next, occurring first at that boundary in ``text``."""
    decoded = [engine.tokenizer.decode(token_ids[:k], skip_special_tokens=True)
               for k in range(len(token_ids) + 1)]
    for before, after in zip(decoded[1:], decoded[2:]):
        if not text.startswith(after) or len(after) <= len(before):
            continue  # the boundary splits a character
        stop = before[-1] + after[len(before)]
        if "\ufffd" not in stop and text.find(stop) == len(before) - 1:
            return stop
    pytest.fail(f"no token boundary in {text!r} to put a stop string across")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_never_reaches_the_stream(engine, include):
    full = run(engine, "hello world", max_tokens=40, ignore_eos=True, **GREEDY)[-1]
    stop = _stop_across_a_token_boundary(engine, full.output_token_ids, full.text)
    stream = run(engine, "hello world", max_tokens=40, stop=(stop,),
                 include_stop_str_in_output=include, **GREEDY)
    cut = full.text.find(stop) + (len(stop) if include else 0)
    assert stream[-1].finish_reason == "stop"
    assert stream[-1].text == full.text[:cut]
    assert "".join(o.delta_text for o in stream) == full.text[:cut]


def test_text_held_for_a_stop_string_that_never_came_is_released_at_the_end(engine):
    full = run(engine, "hello world", max_tokens=12, ignore_eos=True, **GREEDY)[-1]
    stop = full.text[-1] + "\x00never"  # the last character could start it: held, then flushed
    stream = run(engine, "hello world", max_tokens=12, ignore_eos=True, stop=(stop,), **GREEDY)
    assert stream[-1].finish_reason == "length" and stream[-1].text == full.text
    assert "".join(o.delta_text for o in stream) == full.text
