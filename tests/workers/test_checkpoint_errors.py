"""Bad checkpoints and configurations give clear errors that name the problem."""

import json
import shutil

import pytest

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.loader import checkpoint_files


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_architecture(tiny_llama, tmp_path):
    model = copy_checkpoint(tiny_llama, tmp_path / "m")
    edit_config(model, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        LLMEngine(EngineConfig(model=str(model)))


def test_missing_shard_named_in_the_index(tiny_llama, tmp_path):
    model = copy_checkpoint(tiny_llama, tmp_path / "m")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        checkpoint_files(model)


def test_sharded_checkpoint_loads_from_its_index(tiny_llama, tmp_path):
    """A checkpoint split over two files (as transformers saves large models) loads fully."""
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, model / name)
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(model / file), metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=8, dtype="float32"))
    embed = engine.rank.runner.model.model.embed_tokens.weight
    torch.testing.assert_close(embed, tensors["model.embed_tokens.weight"])


def test_no_safetensors_at_all(tiny_llama, tmp_path):
    model = copy_checkpoint(tiny_llama, tmp_path / "m")
    (model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        LLMEngine(EngineConfig(model=str(model)))


def test_tp_size_that_does_not_divide_the_heads(tiny_llama):
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide the model's 4"):
        LLMEngine(EngineConfig(model=str(tiny_llama), tp_size=3))


def test_weights_that_do_not_match_the_config(tiny_llama, tmp_path):
    model = copy_checkpoint(tiny_llama, tmp_path / "m")
    edit_config(model, intermediate_size=128)
    with pytest.raises(ValueError, match=r"mlp\..*_proj.weight has shape .*config.json match"):
        LLMEngine(EngineConfig(model=str(model), num_kv_blocks=8))


def test_invalid_config_json(tiny_llama, tmp_path):
    model = copy_checkpoint(tiny_llama, tmp_path / "m")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LLMEngine(EngineConfig(model=str(model)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_size=0), "--tp must be at least 1"),
    (dict(block_size=12), "--block-size must be a power of two"),
    (dict(num_kv_blocks=0), "--kv-blocks must be at least 1"),
])
def test_bad_engine_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="default", **kwargs)
