"""Architecture name (``config.json`` ``architectures[0]``) -> model class."""

from __future__ import annotations

from typing import Type

from torch import nn

from workers.model_config import SUPPORTED_ARCHITECTURES
from workers.models.llama import LlamaForCausalLM

# Mistral and Qwen2 are Llama with a sliding window or qkv bias, which ModelConfig carries.
_MODELS = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> Type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; tpserve runs "
                         f"{', '.join(sorted(_MODELS))}") from None
