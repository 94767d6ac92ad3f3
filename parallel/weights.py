"""How parallel layers read checkpoint tensors: lazily, only the shard a rank needs.

A ``TensorSource`` is a tensor in a checkpoint file that has not been read yet. A layer's
parameter carries a ``weight_loader(param, source, shard_id)`` that reads just its rows or columns
with ``source.read(dim, start, length)``, so no rank ever holds a full copy of a sharded weight.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch


class TensorSource(Protocol):
    name: str
    shape: Sequence[int]

    def read(self, dim: Optional[int] = None, start: int = 0,
             length: Optional[int] = None) -> torch.Tensor:
        """The whole tensor, or ``length`` entries from ``start`` along ``dim``."""


WeightLoader = Callable[[torch.nn.Parameter, TensorSource, Optional[object]], None]


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, source: TensorSource) -> None:
    """Copy ``loaded`` into ``param`` (casting dtype), or name the tensor whose shape is wrong."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor {source.name} has shape {tuple(source.shape)}; its shard "
            f"{tuple(loaded.shape)} does not fit the model's {tuple(param.shape)} "
            f"(does config.json match the weights?)")
    param.data.copy_(loaded)


def default_weight_loader(param: torch.nn.Parameter, source: TensorSource,
                          shard_id: Optional[object] = None) -> None:
    """Replicated parameters (norms): read the whole tensor."""
    copy_checked(param, source.read(), source)
