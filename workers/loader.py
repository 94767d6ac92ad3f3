"""Load a rank's shard of a Hugging Face safetensors checkpoint into a model.

Files come from ``model.safetensors.index.json`` when present (every shard it names must exist),
else every ``*.safetensors`` in the directory. Each tensor is opened lazily and handed to its
parameter's ``weight_loader``, which reads only the rows or columns this rank owns.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from safetensors import safe_open
from torch import nn

from parallel.weights import default_weight_loader

logger = logging.getLogger(__name__)

# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsSource:
    """One tensor of an open safetensors file, read on demand (``parallel.weights.TensorSource``)."""

    def __init__(self, handle, name: str) -> None:
        self.name = name
        self._slice = handle.get_slice(name)
        self.shape: Sequence[int] = tuple(self._slice.get_shape())

    def read(self, dim: Optional[int] = None, start: int = 0,
             length: Optional[int] = None) -> torch.Tensor:
        if dim is None:
            return self._slice[:]
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + (length if length is not None else self.shape[dim]))
        return self._slice[tuple(index)]


def checkpoint_files(model_dir: Path) -> List[Path]:
    """The safetensors files of a checkpoint; errors name what is missing."""
    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        try:
            weight_map: Dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index_path} is not a safetensors index ({exc})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(
                f"checkpoint shard(s) named in {index_path.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir} (tpserve loads safetensors checkpoints)")
    return files


def _target(name: str, packed: Dict[str, Tuple[str, object]]) -> Tuple[str, Optional[object]]:
    """Map a checkpoint name to (our parameter name, shard id) through the packed mapping."""
    for original, (fused, shard_id) in packed.items():
        part = f".{original}."
        if part in name:
            return name.replace(part, f".{fused}."), shard_id
    return name, None


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint (this rank's shard only)."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: Set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = _target(name, packed)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"{path.name}: tensor {name} has no place in the model "
                                     f"(is config.json for this checkpoint?)")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, SafetensorsSource(handle, name), shard_id)
                loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    logger.info("loaded %d tensors from %s", len(loaded), model_dir)
