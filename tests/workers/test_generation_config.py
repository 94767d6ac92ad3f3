"""EOS ids listed only in ``generation_config.json`` (as Llama 3 Instruct lists ``<|eot_id|>``)
end a request, as they end ``transformers`` generate."""

import json
import logging

import pytest

from tiny_models import build_checkpoint, hf_greedy, set_generation_eos
from workers.config import EngineConfig
from workers.llm import LLM
from workers.model_config import load_model_config
from workers.sampling_params import SamplingParams

PROMPTS = [[17, 4, 250, 31, 99, 8], [5, 6, 7]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gen") / "llama", "llama", seed=3)


def test_stops_on_an_eos_listed_only_in_generation_config(model_dir):
    unstopped = hf_greedy(model_dir, PROMPTS[:1], MAX_NEW)[0]
    # A token first produced mid-way, neither config.json's EOS nor the first output.
    extra = next(t for i, t in enumerate(unstopped) if i >= 3 and t not in unstopped[:i]
                 and t != 2)
    set_generation_eos(model_dir, [2, extra])
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == 2
    references = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    assert references[0] == unstopped[:unstopped.index(extra) + 1]  # transformers honours it

    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=64, dtype="float32")
    with LLM(config) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.output_token_ids for o in outs] == references
    assert outs[0].finish_reason == "stop"


@pytest.mark.parametrize("listed,expected", [(7, (2, 7)), ([2, 9, 7], (2, 9, 7)), (None, (2,))])
def test_eos_ids_are_the_union_of_both_files(model_dir, tmp_path, listed, expected):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text((model_dir / "config.json").read_text())
    set_generation_eos(model, listed)
    assert load_model_config(model).eos_token_ids == expected


@pytest.mark.parametrize("text,why", [
    ("{not json", "not valid JSON"),
    ('{"eos_token_id": "</s>"}', "eos_token_id"),
    ('[2, 3]', "JSON object"),
])
def test_a_malformed_generation_config_is_ignored_with_a_warning(model_dir, tmp_path, caplog,
                                                                  text, why):
    """As vLLM does (transformers raises OSError on it; vLLM falls back to config.json)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text((model_dir / "config.json").read_text())
    (model / "generation_config.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="workers.model_config"):
        assert load_model_config(model).eos_token_ids == (2,)
    assert any("generation_config.json" in r.getMessage() and why in r.getMessage()
               for r in caplog.records)
