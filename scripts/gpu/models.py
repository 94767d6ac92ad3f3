"""Checkpoints for ``scripts/gpu_check.py``, made on the spot with no network: a ``transformers``
Llama config, random weights, ``save_pretrained``, and a byte-level BPE tokenizer trained on a few
sentences. (``tests/tiny_models.py`` does the same for the suite; a script may not import tests.)
Also the ``transformers`` side of the comparisons: loading a checkpoint on a device and greedy
``generate``, one prompt at a time and unpadded, so its ids are the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import torch

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tensor parallel serving splits every layer across ranks",
    "a paged key value cache stores blocks of sixteen tokens",
    "hello world, how are you today? I am fine, thank you.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? . , : ; ( )",
] * 20

_COMMON = dict(bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=False)

# Parity on CPU (the suite's run): two layers, head_dim 16, GQA 2:1, llama3 RoPE scaling.
TINY: Dict[str, object] = dict(
    _COMMON, vocab_size=509, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64})

# Parity on a GPU: head_dim 64 as in Llama-3.2-1B, GQA 4:1, still built and run in seconds.
SMALL: Dict[str, object] = dict(
    _COMMON, vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
    initializer_range=0.1, rope_theta=500000.0)

# Throughput on a GPU: Llama-3.2-1B's shape (1.24B parameters, tied embeddings), random weights.
LLAMA_1B: Dict[str, object] = dict(
    _COMMON, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
    initializer_range=0.02, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

# Throughput on CPU (the suite's run): TINY with tied embeddings, as LLAMA_1B has them.
TINY_TIED: Dict[str, object] = dict(TINY, tie_word_embeddings=True)


def save_tokenizer(out_dir: Path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(out_dir))


def build_checkpoint(out_dir: Path, shape: Dict[str, object], device: str = "cpu",
                     dtype: torch.dtype = torch.float32, seed: int = 0):
    """Save a random Llama of ``shape`` (weights in ``dtype``) with a tokenizer to ``out_dir``;
    returns the ``transformers`` model, on ``device``, in eval mode. The weights are drawn on
    ``device``: a 1B model initialises in seconds on a GPU."""
    import transformers

    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(device=device, dtype=dtype).eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    save_tokenizer(Path(out_dir))
    return model


def load_hf(model_dir: Path, device: torch.device, dtype: torch.dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.to(device).eval()


@torch.no_grad()
def hf_greedy(model, prompts: Sequence[List[int]], max_new_tokens: int) -> List[List[int]]:
    """``transformers`` greedy ids after each prompt (stopping at EOS as the engine does)."""
    outs = []
    for ids in prompts:
        input_ids = torch.tensor([ids], device=model.device)  # [1, S]
        gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


class OnDevice:
    """A ``transformers`` model whose ``generate`` takes inputs built on the CPU and moves them
    to the model's device (``engine_systems.hf_generate_batch`` builds its batches on the CPU)."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        self.generation_config = model.generation_config

    def generate(self, **kwargs):
        moved = {k: v.to(self.model.device) if torch.is_tensor(v) else v
                 for k, v in kwargs.items()}
        return self.model.generate(**moved)
