"""A request resumed on another engine (request migration): given the prompt and the tokens
already produced, it continues exactly where the first engine stopped: the same greedy tokens,
text deltas that add up to the rest of the uninterrupted text, stop strings that span the cut."""

import pytest

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams

PROMPT = [5, 17, 40, 2, 9, 33, 101, 7]
MAX_TOKENS = 14


def run(model_dir, params, resume=()):
    """Every output of one request: (new token ids, delta text) per step, and the last output.
    fp32: in bf16 the resumed request's prefill rounds otherwise than the decodes it replaces, so
    its greedy tokens may leave the uninterrupted ones after the cut."""
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=64, dtype="float32")
    with LLMEngine(config) as engine:
        engine.add_request(PROMPT, params, request_id="r", resume_output_ids=resume)
        steps, last = [], None
        while engine.has_unfinished():
            for out in engine.step():
                steps.append((out.new_token_ids, out.delta_text))
                last = out
        return steps, last


def text_after(steps, num_tokens):
    """The text an uninterrupted run emitted once it had produced ``num_tokens`` tokens."""
    seen, text = 0, ""
    for new_ids, delta in steps:
        if seen >= num_tokens:
            text += delta
        seen += len(new_ids)
    return text


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_resumed_greedy_request_continues_the_uninterrupted_one(tiny_llama, cut):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    steps, whole = run(tiny_llama, params)
    tokens = whole.output_token_ids
    resumed_steps, resumed = run(tiny_llama, params, resume=tokens[:cut])
    assert resumed.output_token_ids == tokens
    assert [t for ids, _ in resumed_steps for t in ids] == tokens[cut:]
    assert "".join(d for _, d in resumed_steps) == text_after(steps, cut)
    assert resumed.finish_reason == "length"


def test_a_stop_string_across_the_cut_still_stops_the_request(tiny_llama):
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    _, whole = run(tiny_llama, free)
    text = whole.text
    assert len(text) >= 6, text
    stop = text[len(text) // 2 - 2:len(text) // 2 + 2]  # four characters from the middle
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop])
    steps, stopped = run(tiny_llama, params)
    for cut in range(1, len(stopped.output_token_ids)):
        resumed_steps, resumed = run(tiny_llama, params, resume=whole.output_token_ids[:cut])
        assert resumed.finish_reason == "stop"
        assert resumed.output_token_ids == stopped.output_token_ids
        assert "".join(d for _, d in resumed_steps) == text_after(steps, cut)


def test_resuming_a_request_of_several_choices_is_refused_by_name(tiny_llama):
    with LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64)) as engine:
        with pytest.raises(ValueError, match="resume_output_ids.*n=1"):
            engine.add_request(PROMPT, SamplingParams(n=2), resume_output_ids=[3])
        with pytest.raises(ValueError, match="resume_output_ids.*max_tokens"):
            engine.add_request(PROMPT, SamplingParams(max_tokens=2), resume_output_ids=[3, 4])
