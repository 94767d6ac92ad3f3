"""A model whose every layer slides frees the blocks that left the window while it decodes, and
its greedy output still equals transformers; a model with a full-attention layer frees nothing.

Window 8, blocks of 4: a request holds at most 8/4 + 2 blocks whatever its length (the window's
blocks, a partly filled one, and the one its next token goes to).
"""

import random

import pytest

from tiny_models import build_checkpoint, hf_greedy
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams

WINDOW, BLOCK = 8, 4
MAX_BLOCKS_PER_REQUEST = WINDOW // BLOCK + 2
FP32_BLOCKS = dict(block_size=BLOCK, dtype="float32")  # fp32: outputs compared to transformers'
MAX_NEW = 90
rng = random.Random(3)
SHARED = [rng.randrange(3, 509) for _ in range(16)]  # 4 full blocks
PROMPTS = [SHARED + [rng.randrange(3, 509) for _ in range(n)] for n in (2, 9)] + [[5, 6, 7]]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("free") / "mistral", "mistral", seed=8,
                            sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(mistral):
    return hf_greedy(mistral, PROMPTS, MAX_NEW)


def generate(engine, prompts):
    """Step to the end; returns the outputs and the blocks in use after each step."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    final, used = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
        used.append(engine.kv_usage().num_used_blocks)
    return [final[i] for i in ids], used


def test_decoding_past_the_window_holds_only_the_window(mistral, reference):
    with LLMEngine(EngineConfig(model=str(mistral), **FP32_BLOCKS, num_kv_blocks=128)) as engine:
        for prompt, expected in zip(PROMPTS, reference):
            out, used = generate(engine, [prompt])
            assert out == [expected]
            assert len(prompt) + len(expected) > 4 * WINDOW  # far past the window
            assert max(used) <= MAX_BLOCKS_PER_REQUEST
        assert engine.kv_usage().num_used_blocks == 0


def test_requests_sharing_cached_prefix_blocks_free_them_independently(mistral, reference):
    """The second pass takes the shared prefix from the cache: both requests reference its
    blocks, and each drops its reference when the blocks leave its own window."""
    with LLMEngine(EngineConfig(model=str(mistral), **FP32_BLOCKS, num_kv_blocks=128)) as engine:
        first, _ = generate(engine, PROMPTS)
        hits_before = engine.scheduler.kv.num_device_hits
        second, used = generate(engine, PROMPTS)
        assert engine.scheduler.kv.num_device_hits - hits_before >= 2 * len(SHARED)
        assert engine.kv_usage().num_used_blocks == 0
    assert first == reference and second == reference
    assert max(used) <= len(PROMPTS) * MAX_BLOCKS_PER_REQUEST


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.multiproc)])
def test_freed_blocks_serve_other_requests_in_a_small_pool(mistral, reference, tp):
    """29 blocks hold one request of the longest context (115 tokens), not the three together
    without freeing. Every rank reads only the window, so a block freed here and written by
    another request is never read stale."""
    config = EngineConfig(model=str(mistral), **FP32_BLOCKS, num_kv_blocks=29, tp_size=tp,
                          enable_prefix_cache=False)
    with LLMEngine(config) as engine:
        out, used = generate(engine, PROMPTS)
        assert engine.scheduler.num_preemptions == 0
    assert out == reference
    assert max(used) <= len(PROMPTS) * MAX_BLOCKS_PER_REQUEST


def test_a_model_with_full_attention_layers_frees_nothing(tmp_path):
    """Qwen2 with its first layer full and the second windowed: every block stays."""
    model = build_checkpoint(tmp_path / "qwen2", "qwen2", seed=9, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=1)
    prompt = PROMPTS[1]
    expected = hf_greedy(model, [prompt], 40)[0]
    with LLMEngine(EngineConfig(model=str(model), **FP32_BLOCKS, num_kv_blocks=128)) as engine:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0.0))
        while True:
            outs = engine.step()
            if outs[-1].finished:
                break
            computed = len(prompt) + len(outs[-1].output_token_ids) - 1
            assert engine.kv_usage().num_used_blocks == -(-computed // BLOCK)
    assert outs[-1].request_id == rid and outs[-1].output_token_ids == expected


def test_with_a_host_tier_freed_window_blocks_are_kept_on_host(mistral, reference):
    """Blocks freed as they leave the window are written through like any released block, so a
    second pass finds the prompts' leading blocks on host although the device evicted them."""
    config = EngineConfig(model=str(mistral), **FP32_BLOCKS, num_kv_blocks=29,
                          host_kv_blocks=256)
    with LLMEngine(config) as engine:
        first, _ = generate(engine, PROMPTS)
        second, used = generate(engine, PROMPTS)
        stats = engine.kv_tier_stats()
        assert engine.scheduler.kv.num_prefix_hits > engine.scheduler.kv.num_device_hits
    assert first == reference and second == reference
    assert stats["kv_tier_restored_bytes_total"] > 0
    assert max(used) <= len(PROMPTS) * MAX_BLOCKS_PER_REQUEST
