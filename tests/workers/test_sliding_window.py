"""Sliding-window attention, layer by layer, equals transformers token for token.

Qwen2 windows only the layers ``layer_types`` marks ``sliding_attention`` (transformers 5.x
writes it; 4.x configs derive it from ``max_window_layers``: layers with index >= it slide);
Mistral windows every layer. The window is small (8 tokens) and the prompts and decodes run
well past it.
"""

import json
import random
import shutil

import pytest

from tiny_models import build_checkpoint, hf_greedy
from workers.config import EngineConfig
from workers.llm import LLM
from workers.model_config import load_model_config
from workers.sampling_params import SamplingParams

WINDOW = 8
MAX_NEW = 24


def make_prompts():
    rng = random.Random(11)
    shared = [rng.randrange(3, 509) for _ in range(14)]
    fresh = lambda n: [rng.randrange(3, 509) for _ in range(n)]  # noqa: E731
    return [fresh(5), shared + fresh(6), fresh(27), shared + fresh(11), fresh(9)]


PROMPTS = make_prompts()


def generate(model_dir, **engine_kwargs):
    config = EngineConfig(model=str(model_dir), block_size=4, dtype="float32", **engine_kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    with LLM(config) as llm:
        first = [o.output_token_ids for o in llm.generate(PROMPTS, params)]
        second = [o.output_token_ids for o in llm.generate(PROMPTS, params)]  # prefix hits
    return first, second


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory):
    """Three layers, the first full and the last two windowed (max_window_layers=1)."""
    return build_checkpoint(tmp_path_factory.mktemp("swa") / "qwen2", "qwen2", seed=5,
                            num_hidden_layers=3, use_sliding_window=True,
                            sliding_window=WINDOW, max_window_layers=1)


@pytest.mark.parametrize("layout", ["layer_types", "max_window_layers", "alternating"])
def test_qwen2_windows_only_its_sliding_layers(qwen2_mixed, tmp_path, layout):
    model = shutil.copytree(qwen2_mixed, tmp_path / "m")
    if layout == "max_window_layers":  # a transformers 4.x config: no layer_types
        edit_config(model, layer_types=None)
    elif layout == "alternating":  # layer_types wins over max_window_layers
        edit_config(model, layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention"])
    expected_windows = {"alternating": (WINDOW, None, WINDOW)}.get(layout, (None, WINDOW, WINDOW))
    assert load_model_config(model).layer_windows == expected_windows
    reference = hf_greedy(model, PROMPTS, MAX_NEW)
    first, second = generate(model, num_kv_blocks=128)
    assert first == reference and second == reference
    chunked, _ = generate(model, num_kv_blocks=128, max_num_batched_tokens=7)
    assert chunked == reference


def test_qwen2_without_use_sliding_window_attends_fully(qwen2_mixed, tmp_path):
    model = shutil.copytree(qwen2_mixed, tmp_path / "m")
    edit_config(model, use_sliding_window=False)
    assert load_model_config(model).layer_windows == (None, None, None)


def test_mistral_windows_every_layer(tmp_path):
    model = build_checkpoint(tmp_path / "mistral", "mistral", seed=6, num_hidden_layers=3,
                             sliding_window=WINDOW)
    assert load_model_config(model).layer_windows == (WINDOW,) * 3
    reference = hf_greedy(model, PROMPTS, MAX_NEW)
    first, second = generate(model, num_kv_blocks=128)
    assert first == reference and second == reference


@pytest.mark.parametrize("layer_types,match", [
    (["full_attention", "sliding_attention"], "3 layers"),
    (["full_attention", "chunked_attention", "sliding_attention"], "chunked_attention"),
])
def test_bad_layer_types_name_the_field(qwen2_mixed, tmp_path, layer_types, match):
    model = shutil.copytree(qwen2_mixed, tmp_path / "m")
    edit_config(model, layer_types=layer_types)
    with pytest.raises(ValueError, match=f"config.json: layer_types.*{match}"):
        load_model_config(model)
