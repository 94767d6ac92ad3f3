"""Checks and conversions of a request on its way into the engine (``LLMEngine.add_request``):
its prompt as token ids, its token-id parameters, the tokens it resumes after, its generator.
Each raises ``ValueError`` naming the input and what was expected."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence, Union

import torch

from workers.sampling_params import SamplingParams


def tokenize(prompt: Union[str, Sequence[int]], tokenizer, vocab_size: int,
             model_dir: Path) -> List[int]:
    """The prompt's token ids: text through ``tokenizer``, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer files: pass token ids")
        token_ids = tokenizer.encode(prompt)
    else:
        token_ids = list(prompt)
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); "
                             f"got {bad[:5]}")
    if not token_ids:
        raise ValueError("prompt is empty")
    return token_ids


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    for name in ("logit_bias", "stop_token_ids"):
        bad = [t for t in getattr(params, name) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad[:5]}")


def check_resume(resume: List[int], params: SamplingParams, vocab_size: int) -> List[int]:
    """The tokens a migrated request already produced: one choice, within ``max_tokens``."""
    if not resume:
        return resume
    if params.n != 1:
        raise ValueError(f"resume_output_ids (a migrated request) needs n=1, got n={params.n}")
    if len(resume) >= params.max_tokens:
        raise ValueError(f"resume_output_ids holds {len(resume)} tokens: nothing is left "
                         f"to generate within max_tokens={params.max_tokens}")
    bad = [t for t in resume if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"resume_output_ids must be integers in [0, {vocab_size}); "
                         f"got {bad[:5]}")
    return resume


def choice_generator(params: SamplingParams, index: int, num_resumed: int,
                     device: torch.device, shared: torch.Generator) -> torch.Generator:
    """Choice ``index`` of a seeded request draws from ``seed + index`` (moved by the number of
    resumed tokens), on the device of the logits (the sampler draws there); unseeded ones share
    the engine's generator ``shared``."""
    if params.seed is None:
        return shared
    seed = params.seed + index + num_resumed * 0x9E3779B97F4A7C15
    return torch.Generator(device).manual_seed(seed % (1 << 64))
