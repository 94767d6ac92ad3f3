"""Greedy output equals transformers' generate, token for token, at TP 1, 2 and 4.

Tiny random checkpoints (Llama with GQA and llama3 RoPE scaling, tied-embedding Llama, Qwen2 with
qkv bias, Mistral with a sliding window and one KV head) saved by transformers; a vocabulary of
509 so it splits unevenly over 2 and 4 ranks. Prompts of different lengths are submitted
together; some share prefixes, and a second pass over the same engine hits the prefix cache.
"""

import random

import pytest

from tiny_models import build_checkpoint, hf_greedy
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams

MAX_NEW = 20
KINDS = ("llama", "llama_tied", "qwen2", "mistral")


def make_prompts():
    rng = random.Random(7)
    shared = [rng.randrange(3, 509) for _ in range(21)]
    fresh = lambda n: [rng.randrange(3, 509) for _ in range(n)]  # noqa: E731
    return [fresh(5), shared + fresh(3), fresh(33), shared[:13] + fresh(9), fresh(1),
            shared + fresh(12), fresh(47)]


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: build_checkpoint(root / kind, kind, seed=i) for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: hf_greedy(path, PROMPTS, MAX_NEW) for kind, path in checkpoints.items()}


def run_twice(model_dir, **engine_kwargs):
    """Generate the batch twice on one engine; returns both passes' ids and the engine stats."""
    config = EngineConfig(model=str(model_dir), block_size=4, dtype="float32", **engine_kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with LLM(config) as llm:
        first = [o.output_token_ids for o in llm.generate(PROMPTS, params)]
        second = [o.output_token_ids for o in llm.generate(PROMPTS, params)]
        kv = llm.engine.scheduler.kv
        return first, second, kv.num_prefix_hits, llm.engine.scheduler.num_preemptions


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_tp1_matches_transformers(checkpoints, references, kind, prefix_cache):
    first, second, hits, _ = run_twice(checkpoints[kind], enable_prefix_cache=prefix_cache,
                                       num_kv_blocks=256)
    assert first == references[kind]
    assert second == references[kind]
    assert (hits > 0) == prefix_cache


@pytest.mark.parametrize("kind", KINDS)
def test_tp1_matches_transformers_under_preemption(checkpoints, references, kind):
    first, second, _, preemptions = run_twice(checkpoints[kind], num_kv_blocks=24)
    assert preemptions > 0
    assert first == references[kind] and second == references[kind]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_tp1_matches_transformers_on_both_cpu_decode_paths(checkpoints, references, kind,
                                                           decode_path):
    """Decodes on the C kernel and on the PyTorch path it replaces (GQA; one KV head and a
    sliding window)."""
    first, second, _, _ = run_twice(checkpoints[kind], num_kv_blocks=256)
    assert first == references[kind] and second == references[kind]


def test_chunked_prefill_matches_transformers(checkpoints, references):
    first, _, _, _ = run_twice(checkpoints["qwen2"], max_num_batched_tokens=7,
                               num_kv_blocks=256)
    assert first == references["qwen2"]


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,tp,blocks,has_hits", [
    ("llama", 2, 24, True),  # GQA split 1 KV head per rank, preemption, prefix hits
    ("qwen2", 2, 256, True),
    # One KV head replicated on 4 ranks, sliding window, preemption. Every layer slides, so
    # leading blocks are freed as they leave the window; in a pool this tight they are evicted
    # before a prompt looks for them again, and the prefix cache finds nothing.
    ("mistral", 4, 24, False),
    ("llama_tied", 4, 256, True),  # tied LM head over an uneven vocab split
])
def test_tensor_parallel_matches_transformers(checkpoints, references, kind, tp, blocks,
                                              has_hits):
    first, second, hits, preemptions = run_twice(checkpoints[kind], tp_size=tp,
                                                 num_kv_blocks=blocks)
    assert first == references[kind]
    assert second == references[kind]
    assert (hits > 0) == has_hits
    assert (preemptions > 0) == (blocks == 24)


@pytest.mark.multiproc
def test_tensor_parallel_without_prefix_cache(checkpoints, references):
    first, _, hits, _ = run_twice(checkpoints["llama"], tp_size=2, num_kv_blocks=256,
                                  enable_prefix_cache=False)
    assert first == references["llama"] and hits == 0
