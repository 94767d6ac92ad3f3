"""SmolLM2-135M-Instruct (the default model, real weights): greedy ids equal transformers' for
32 new tokens on several prompts, at TP 1 and 3 (its 9 heads divide by 1, 3 and 9 only)."""

import pytest

from workers.config import EngineConfig
from workers.default_model import resolve_model_path
from workers.llm import LLM
from workers.sampling_params import SamplingParams

from tiny_models import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Tensor parallelism splits each layer of a transformer across",
    "Once upon a time, in a small village by the sea,",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def smollm2(default_model_cache):
    with pytest.MonkeyPatch.context() as patch:  # "default" as a user names it, in this cache
        patch.setenv("TPSERVE_CACHE", str(default_model_cache))
        model_dir = resolve_model_path("default")
    assert model_dir.is_relative_to(default_model_cache)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    token_ids = [tokenizer.encode(p) for p in PROMPTS]
    return model_dir, token_ids, hf_greedy(model_dir, token_ids, MAX_NEW)


@pytest.mark.parametrize("tp", [1, pytest.param(3, marks=pytest.mark.multiproc)])
def test_smollm2_greedy_matches_transformers(smollm2, tp):
    model_dir, token_ids, expected = smollm2
    config = EngineConfig(model=str(model_dir), tp_size=tp, num_kv_blocks=128,
                          dtype="float32")
    with LLM(config) as llm:
        outs = llm.generate(token_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.output_token_ids for o in outs] == expected


def test_smollm2_in_bf16_answers_sanely(smollm2):
    """bf16 (what ``auto`` picks on a CPU with AMX or AVX-512 BF16): the prefill's argmax agrees
    with transformers' fp32 on most prompts, and the completions still say what they should."""
    model_dir, token_ids, expected = smollm2
    config = EngineConfig(model=str(model_dir), num_kv_blocks=128, dtype="bfloat16")
    with LLM(config) as llm:
        outs = llm.generate(token_ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    got = [o.output_token_ids for o in outs]
    assert sum(g[:1] == e[:1] for g, e in zip(got, expected)) >= len(PROMPTS) - 1, (got, expected)
    assert "Paris" in outs[0].text, outs[0].text  # "The capital of France is"
    assert "return" in outs[1].text or "fibonacci" in outs[1].text, outs[1].text
