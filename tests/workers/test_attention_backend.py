"""``--attention-backend``: the choice, its errors, and whole-engine greedy parity of the Triton
kernels (on CPU under Triton's interpreter) with ``transformers`` and with the torch backend."""

import os

# Before triton's @jit decorates the kernels, which happens when an engine first builds the
# triton backend; TRITON_INTERPRET=0 runs them on a GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kv.attention.backend import (resolve_attention_backend,  # noqa: E402
                                  sdpa_for_fresh_prefills)
from tiny_models import build_checkpoint, hf_greedy  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# A dev dependency, but without wheels off Linux.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
MAX_NEW = 8


def make_prompts():
    rng = random.Random(11)
    shared = [rng.randrange(3, 509) for _ in range(21)]
    fresh = lambda n: [rng.randrange(3, 509) for _ in range(n)]  # noqa: E731
    return [fresh(5), shared + fresh(3), fresh(33), shared[:13] + fresh(4), fresh(1)]


PROMPTS = make_prompts()


def generate_twice(model_dir, backend, **engine_kwargs):
    """Both passes' greedy ids (the second hits the prefix cache) and the prefix hits."""
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=128,
                          attention_backend=backend, **{"dtype": "float32", **engine_kwargs})
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with LLM(config) as llm:
        assert llm.engine.rank.runner.model.attention.name == backend
        first = [o.output_token_ids for o in llm.generate(PROMPTS, params)]
        second = [o.output_token_ids for o in llm.generate(PROMPTS, params)]
        return first, second, llm.engine.scheduler.kv.num_prefix_hits


@needs_triton
def test_auto_is_torch_on_cpu_and_triton_on_cuda():
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert resolve_attention_backend("auto", CUDA) == "triton"
    assert resolve_attention_backend("torch", CUDA) == "torch"
    assert resolve_attention_backend("triton", CPU) == "triton"  # TRITON_INTERPRET=1 here


@pytest.mark.parametrize("device, dtype, expected", [
    ("cuda", torch.bfloat16, True), ("cuda", torch.float16, True),
    # fp32 has no FlashAttention: SDPA would take its math path and a [H, L, L] score matrix
    ("cuda", torch.float32, False), ("cpu", torch.bfloat16, False), ("cpu", torch.float32, False),
])
def test_fresh_prefills_go_to_sdpa_on_cuda_in_half_precision_only(device, dtype, expected):
    assert sdpa_for_fresh_prefills(device, dtype) is expected


def test_bad_value_names_the_flag():
    with pytest.raises(ValueError, match="--attention-backend must be auto, torch or triton"):
        EngineConfig(model="default", attention_backend="flash")
    with pytest.raises(ValueError, match="--attention-backend must be"):
        resolve_attention_backend("Triton", CPU)


@needs_triton
def test_triton_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1") as info:
        resolve_attention_backend("triton", CPU)
    assert "--attention-backend torch" in str(info.value)
    assert resolve_attention_backend("triton", CUDA) == "triton"  # compiles there


def test_missing_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(ValueError, match=r"needs the triton package .*pip install triton"):
        resolve_attention_backend("triton", CUDA)
    assert resolve_attention_backend("auto", CUDA) == "torch"  # with a warning


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


@needs_triton
def test_triton_engine_matches_transformers_and_torch(tiny_llama, llama_reference):
    """GQA 2; chunks of 16 tokens attend over their cached first chunks; the second pass
    prefills over prefixes cached by the first."""
    triton_run = generate_twice(tiny_llama, "triton", max_num_batched_tokens=16)
    torch_run = generate_twice(tiny_llama, "torch", max_num_batched_tokens=16)
    first, second, hits = triton_run
    assert first == llama_reference and second == llama_reference and hits > 0
    assert triton_run == torch_run


@needs_triton
def test_triton_engine_with_a_sliding_window(tmp_path):
    """Mistral (one KV head, window 12) decoding past its window: blocks that left the window of
    every layer are freed while the request runs, and never read."""
    model_dir = build_checkpoint(tmp_path / "mistral", "mistral", seed=3, sliding_window=12)
    reference = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    first, second, _ = generate_twice(model_dir, "triton")
    assert first == reference and second == reference


def tpserve(*args, env):
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@needs_triton
def test_cli_generate_triton_equals_torch(tiny_llama):
    # fp32: Triton's CPU interpreter does not do bf16 arithmetic as a GPU does
    base = ("generate", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "5",
            "--block-size", "4", "--kv-blocks", "64", "--json", "--prompt", "hello world", "the quick brown fox")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with_torch = tpserve(*base, "--attention-backend", "torch", env=env)
    with_triton = tpserve(*base, "--attention-backend", "triton", env=env)
    assert with_torch.returncode == 0, with_torch.stderr
    assert with_triton.returncode == 0, with_triton.stderr
    assert [json.loads(line) for line in with_triton.stdout.splitlines()] == \
        [json.loads(line) for line in with_torch.stdout.splitlines()]
    assert len(with_torch.stdout.splitlines()) == 2


@needs_triton
def test_cli_triton_on_cpu_without_interpreter_is_a_clear_error(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = tpserve("generate", "--model", str(tiny_llama), "--attention-backend", "triton",
                     "--prompt", "hi", env=env)
    assert result.returncode == 2
    assert "set TRITON_INTERPRET=1" in result.stderr and "Traceback" not in result.stderr


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any import of triton raises ImportError
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
config = EngineConfig(model=sys.argv[1], block_size=4, num_kv_blocks=64)
with LLM(config) as llm:
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0))
print(llm.engine.rank.runner.model.attention.name, out[0].output_token_ids)
try:
    LLM(EngineConfig(model=sys.argv[1], attention_backend="triton"))
except ValueError as exc:
    print(exc)
"""


def test_engine_runs_without_triton_on_the_torch_backend(tiny_llama):
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(tiny_llama)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("torch [") and len(json.loads(lines[0][6:])) == 3
    assert "needs the triton package" in lines[1] and "pip install triton" in lines[1]


@needs_triton
@pytest.mark.multiproc
def test_triton_engine_at_tp2(tiny_llama, llama_reference):
    """Each rank attends over its own heads (2 query heads, 1 KV head) with the kernels."""
    first, second, _ = generate_twice(tiny_llama, "triton", tp_size=2)
    assert first == llama_reference and second == llama_reference
