"""Constrained requests through the scheduler's paths: prefix-cache hits, chunked prefill (only
the chunk that samples is masked) and preemption by recompute (the matcher keeps its place)
give the same greedy outputs as an engine where none of them happens. In fp32, the dtype of
parity: in bf16 the prefill after a prefix-cache hit (a masked or split flash call over the
uncached rows) rounds otherwise than the fresh prefill's one causal call, which can flip a near
tie (on an AVX-512 BF16 host, one digit of the first prompt)."""

import re

import pytest

from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.structured.spec import StructuredOutput

DIGITS = "[0-9]{24}"  # SmolLM2 writes one token per digit: 24 tokens, then the stop token
PROMPTS = ["one two three four five six seven eight nine ten eleven twelve thirteen",
           "a b c d e f g h i j k l m n o p q r s t u v w x y z",
           "the quick brown fox jumps over the lazy dog again and again and again"]


def params(**extra):
    return SamplingParams(max_tokens=64, temperature=0.0,
                          structured=StructuredOutput("regex", DIGITS), **extra)


@pytest.fixture(scope="module")
def big_pool(smollm2_tiny):
    """A pool that never preempts, steps that never chunk a prompt."""
    with LLM(EngineConfig(model=str(smollm2_tiny), block_size=4, num_kv_blocks=256,
                          max_model_len=256, dtype="float32")) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(big_pool):
    """Each prompt alone (the prompts share no block: nothing is found in the prefix cache)."""
    outs = [big_pool.generate([prompt], params())[0].output_token_ids for prompt in PROMPTS]
    assert big_pool.engine.scheduler.kv.num_device_hits == 0
    return outs


def test_preempted_and_chunked_constrained_requests_finish_as_alone(smollm2_tiny, reference):
    # 3 requests of about 40 tokens in a pool of 24 blocks of 4: they preempt one another;
    # prompts of 14+ tokens in steps of 8 tokens: every prefill is chunked. The overlapped
    # loop (the reference ran serially) reads a constrained request's ids before scheduling it.
    config = EngineConfig(model=str(smollm2_tiny), block_size=4, num_kv_blocks=24,
                          max_model_len=96, max_num_batched_tokens=8, async_scheduling=True,
                          dtype="float32")
    with LLM(config) as llm:
        outs = llm.generate(PROMPTS, params())
        assert llm.engine.scheduler.num_preemptions > 0
    for out, expected in zip(outs, reference):
        assert out.finish_reason == "stop" and re.fullmatch(DIGITS, out.text), out.text
        assert out.output_token_ids == expected


def test_prefix_cache_hits_do_not_change_constrained_outputs(big_pool, reference):
    again = big_pool.generate(PROMPTS, params())
    assert big_pool.engine.scheduler.kv.num_device_hits > 0
    assert [o.output_token_ids for o in again] == reference
