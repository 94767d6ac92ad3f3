"""A checkpoint's ``config.json``, read into the few fields the Llama-family models need.

Both spellings of RoPE settings are accepted: ``rope_theta`` + ``rope_scaling`` (checkpoints
saved by transformers 4.x) and ``rope_parameters`` (transformers 5.x). EOS ids are those of
``config.json`` and of ``generation_config.json`` together: chat checkpoints (Llama 3 Instruct's
``<|eot_id|>``) list their end-of-turn ids in the second file only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    layer_windows: Tuple[Optional[int], ...]  # per layer: its sliding window in tokens, or None
    torch_dtype: str
    eos_token_ids: tuple
    bos_token_id: Optional[int]

    @property
    def shared_window(self) -> Optional[int]:
        """The window when every layer has the same one, else None. Only then may KV blocks
        that left the window be freed: a full-attention layer reads every token."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ``ValueError`` unless the heads split evenly over ``tp_size`` ranks."""
        if self.num_heads % tp_size:
            raise ValueError(
                f"tensor-parallel size {tp_size} does not divide the model's {self.num_heads} "
                f"attention heads; use a divisor of {self.num_heads}")
        kv = self.num_kv_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            raise ValueError(
                f"tensor-parallel size {tp_size} and the model's {kv} KV heads: one must "
                f"divide the other")


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read and check ``model_dir/config.json``, adding the EOS ids ``generation_config.json``
    lists; errors name the file and the field."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face checkpoint directory")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    config = parse_model_config(raw, str(path))
    extra = [t for t in read_generation_eos(Path(model_dir)) if t not in config.eos_token_ids]
    return replace(config, eos_token_ids=config.eos_token_ids + tuple(extra))


def read_generation_eos(model_dir: Path) -> Tuple[int, ...]:
    """The ``eos_token_id`` of ``model_dir/generation_config.json`` (int or list), () without one.

    A file that cannot be read as such is ignored with a warning naming it, as vLLM does
    (transformers refuses it with ``OSError``; vLLM then falls back to ``config.json``)."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return ()
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        logger.warning("%s is not valid JSON (%s); ignoring it, EOS ids from config.json only",
                       path, exc)
        return ()
    if not isinstance(raw, dict):
        logger.warning("%s is not a JSON object; ignoring it, EOS ids from config.json only", path)
        return ()
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        logger.warning("%s: eos_token_id %r is not a token id or a list of them; ignoring it",
                       path, eos)
        return ()
    return tuple(ids)


def parse_model_config(raw: Dict[str, Any], source: str = "config.json") -> ModelConfig:
    arch = (raw.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: architecture {arch!r} is not supported; tpserve runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key: str) -> Any:
        if key not in raw:
            raise ValueError(f"{source}: missing {key!r}")
        return raw[key]

    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    is_qwen2 = arch == "Qwen2ForCausalLM"
    num_layers = need("num_hidden_layers")
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
        o_bias=not is_qwen2 and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=_parse_rope(raw, source),
        layer_windows=_layer_windows(raw, arch, num_layers, source),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        bos_token_id=raw.get("bos_token_id"),
    )


def _layer_windows(raw: Dict[str, Any], arch: str, num_layers: int,
                   source: str) -> Tuple[Optional[int], ...]:
    """Each layer's sliding window, following transformers 5.x.

    Mistral slides on every layer when ``sliding_window`` is set (its ``layer_types`` are
    ignored, as transformers ignores them). Qwen2 slides only with ``use_sliding_window``, and
    only on the layers ``layer_types`` marks ``sliding_attention``; a config without
    ``layer_types`` (transformers 4.x) marks the layers with index >= ``max_window_layers``.
    Llama has no window."""
    window = raw.get("sliding_window")
    is_qwen2 = arch == "Qwen2ForCausalLM"
    if (arch == "LlamaForCausalLM" or window is None
            or (is_qwen2 and not raw.get("use_sliding_window", False))):
        return (None,) * num_layers
    if type(window) is not int or window < 1:
        raise ValueError(f"{source}: sliding_window {window!r} is not a positive token count")
    if not is_qwen2:
        return (window,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = raw.get("max_window_layers", 28)  # transformers' Qwen2Config default
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]
    if not isinstance(layer_types, list):
        raise ValueError(f"{source}: layer_types {layer_types!r} is not a list of layer types")
    layer_types = ["full_attention" if t == "attention" else t for t in layer_types]  # legacy name
    if len(layer_types) != num_layers:
        raise ValueError(f"{source}: layer_types lists {len(layer_types)} layers; the model has "
                         f"{num_layers} layers (num_hidden_layers)")
    unknown = sorted({str(t) for t in layer_types} - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{source}: layer_types {', '.join(unknown)} not supported; expected "
                         f"{' or '.join(LAYER_TYPES)} for each layer")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _parse_rope(raw: Dict[str, Any], source: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported "
                         f"(default, linear, llama3)")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )
