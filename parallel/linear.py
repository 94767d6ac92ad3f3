"""Column- and row-parallel linear layers, with merged variants for fused QKV and gate/up.

- Column-parallel: each rank owns ``out_features / tp`` output rows; no communication.
- Row-parallel: each rank owns ``in_features / tp`` input columns; its partial products are summed
  with one all-reduce, and the bias is added once, after the sum.

Each parameter's ``weight_loader`` narrows the checkpoint tensor to the rank's shard while reading.
Once loaded, ``pack_weights`` may give a layer a oneDNN copy of its shard to multiply with on CPU
(``parallel/onednn_linear.py``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from parallel.onednn_linear import Pack, Packed, dense_or_packed, pack_if_possible
from parallel.tp_group import TPGroup
from parallel.weights import TensorSource, copy_checked, set_weight_loader


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split by output rows; ``sizes`` lists the fused outputs."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool,
                 tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.local_sizes = [_divide(n, tp.world_size, "linear output size") for n in output_sizes]
        local_out = sum(self.local_sizes)
        self.weight = _param((local_out, in_features), dtype, tp.device)
        set_weight_loader(self.weight, self.load_shard)
        self.bias = _param((local_out,), dtype, tp.device) if bias else None
        if self.bias is not None:
            set_weight_loader(self.bias, self.load_shard)
        self.packed: Optional[Packed] = None

    def pack_weights(self, pack: Pack = pack_if_possible) -> bool:
        """Multiply with a packed copy of the loaded weight from now on, where the CPU allows."""
        self.packed = pack(self.weight)
        return self.packed is not None

    def shard_range(self, shard_id: Optional[int]) -> tuple:
        """(offset in the local parameter, start in the checkpoint tensor, length) of a shard."""
        index = shard_id or 0
        size = self.local_sizes[index]
        return sum(self.local_sizes[:index]), self.tp.rank * size, size

    def load_shard(self, param: nn.Parameter, source: TensorSource,
                   shard_id: Optional[int] = None) -> None:
        offset, start, length = self.shard_range(shard_id)
        copy_checked(param.data.narrow(0, offset, length), source.read(0, start, length), source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_or_packed(x, self.weight, self.packed, self.bias)  # [T, local_out]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads are split when there are at least ``tp`` of them and
    replicated otherwise (each rank then holds the one KV head its query heads use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup, dtype: torch.dtype) -> None:
        world = tp.world_size
        self.num_local_heads = _divide(num_heads, world, "number of attention heads")
        if num_kv_heads >= world:
            self.num_local_kv_heads = _divide(num_kv_heads, world, "number of KV heads")
            self.kv_head_start = tp.rank * self.num_local_kv_heads
        else:
            _divide(world, num_kv_heads, "tensor-parallel size over the number of KV heads")
            self.num_local_kv_heads = 1
            self.kv_head_start = tp.rank // (world // num_kv_heads)
        self.head_dim = head_dim
        q_size = self.num_local_heads * head_dim
        kv_size = self.num_local_kv_heads * head_dim
        super().__init__(hidden_size, [q_size * world, kv_size * world, kv_size * world],
                         bias, tp, dtype)

    def shard_range(self, shard_id: Optional[int]) -> tuple:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]  # type: ignore[index]
        size = self.local_sizes[index]
        offset = sum(self.local_sizes[:index])
        start = self.tp.rank * size if index == 0 else self.kv_head_start * self.head_dim
        return offset, start, size

    def split(self, qkv: torch.Tensor) -> List[torch.Tensor]:
        return list(qkv.split(self.local_sizes, dim=-1))


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local W_local^T) + b`` with ``W`` split by input columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.local_in = _divide(in_features, tp.world_size, "linear input size")
        self.weight = _param((out_features, self.local_in), dtype, tp.device)
        set_weight_loader(self.weight, self.load_weight)
        self.bias = _param((out_features,), dtype, tp.device) if bias else None
        if self.bias is not None:
            set_weight_loader(self.bias, lambda p, s, _=None: copy_checked(p, s.read(), s))
        self.packed: Optional[Packed] = None

    def pack_weights(self, pack: Pack = pack_if_possible) -> bool:
        """Multiply with a packed copy of the loaded shard from now on, where the CPU allows."""
        self.packed = pack(self.weight)
        return self.packed is not None

    def load_weight(self, param: nn.Parameter, source: TensorSource, shard_id=None) -> None:
        start = self.tp.rank * self.local_in
        copy_checked(param, source.read(1, start, self.local_in), source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dense_or_packed(x, self.weight, self.packed)  # [T, out] this rank's partial sum
        out = self.tp.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
