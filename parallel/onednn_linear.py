"""Linears on CPU through oneDNN, with each weight reordered once, after loading.

Why: torch's CPU ``F.linear`` in fp32 runs MKL's sgemm, which on AMD processors takes its AVX2
path even where the CPU has AVX-512, and packs the weight again on every call. oneDNN (bundled
with torch as MKL-DNN) dispatches on the CPU's instruction set, and a weight reordered into its
blocked layout once is read as is by every call. Measured on a 2-core AMD EPYC (Zen 5, AVX-512):
a 2048^3 product at 98 GFLOP/s through MKL and 220 through oneDNN; SmolLM2-135M's linears at 16
to 64 tokens 2-4x faster.

The results are fp32 (no reduced-precision math) but summed in another order than MKL's, so not
bitwise equal to ``F.linear``: within about 1e-4 absolute for unit-scale inputs at K = 576.

oneDNN builds (JIT-compiles) a kernel for each row count it meets, the first time: up to a few ms a
shape. So a call's rows are padded up to a bucket (`padded_rows`: exact up to 32, then 8 buckets
per doubling, under 1/8 padding), which bounds the kernels a server builds, and `warm_up_linears`
builds those of every decode batch size when a rank starts.

Layers keep their dense ``weight`` (the loader writes it, tests and tied heads read it) and call
their packed copy when they hold one: a ``PackedWeight``, or whatever the ``pack`` function given
to ``pack_linear_weights`` returns (a CPU rank's takes tpserve's bf16 kernel where the CPU has
AVX-512 BF16 and no AMX: `workers.models.bf16_linear`). ``pack_linear_weights`` packs every
layer of a model that offers ``pack_weights``; set ``TPSERVE_ONEDNN_LINEAR=0`` to keep torch's
default linears.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
EXACT_ROWS = 32  # row counts up to this run as they are
BUCKETS_PER_DOUBLING = 8


def padded_rows(rows: int) -> int:
    """The row count a call of ``rows`` rows runs at: ``rows`` up to `EXACT_ROWS`, above it the
    next multiple of ``2 ** (floor(log2(rows)) - 3)`` (less than 1/8 of padding)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - BUCKETS_PER_DOUBLING.bit_length())  # 2^(floor - 3)
    return -(-rows // step) * step


def can_pack(weight: torch.Tensor) -> bool:
    """True when ``weight`` ``[out, in]`` can run through a packed oneDNN linear here."""
    if os.environ.get("TPSERVE_ONEDNN_LINEAR", "1").lower() in ("0", "false", "off", "no"):
        return False
    return (weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in _PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_thread_buffers = threading.local()


def _pad_buffer(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, columns]`` of ``dtype`` from a buffer of the calling thread, kept between calls
    (so a padded call copies its rows once instead of allocating and concatenating). Its rows
    hold whatever earlier calls left: a product's rows are independent, so rows past a call's
    own change nothing but their dropped outputs."""
    buffers = getattr(_thread_buffers, "by_shape", None)
    if buffers is None:
        buffers = _thread_buffers.by_shape = {}
    buffer = buffers.get((columns, dtype))
    if buffer is None or buffer.shape[0] < rows:
        buffer = buffers[(columns, dtype)] = torch.zeros(rows, columns, dtype=dtype)
    return buffer[:rows]


class PackedWeight:
    """``weight`` ``[out, in]`` reordered for oneDNN; ``linear(x, bias)`` is ``F.linear``'s
    result for ``x`` ``[T, in]``. Costs a second copy of the weight in memory."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [T, in]
        num_rows = rows.shape[0]
        if num_rows == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        padded = padded_rows(num_rows)
        if padded != num_rows:  # rows below from this thread's buffer, their outputs dropped
            buffer = _pad_buffer(padded, self.in_features, rows.dtype)
            buffer[:num_rows].copy_(rows)
            rows = buffer
        elif not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        if padded != num_rows:
            out = out[:num_rows]
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def warm_up(self, max_rows: int, dtype: torch.dtype) -> int:
        """Runs once at each bucket of `padded_rows` up to ``max_rows`` rows of ``dtype``, so
        oneDNN has built their kernels; returns how many calls."""
        sizes = sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})
        for size in sizes:
            self.linear(torch.zeros(size, self.in_features, dtype=dtype))
        return len(sizes)


class Packed(Protocol):
    """What a layer's ``packed`` holds: a copy of its weight that ``linear`` multiplies with."""

    out_features: int
    in_features: int
    packed: torch.Tensor

    def linear(self, x: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def warm_up(self, max_rows: int, dtype: torch.dtype) -> int: ...


Pack = Callable[[torch.Tensor], Optional[Packed]]  # a weight -> its packed copy, or None


def pack_if_possible(weight: torch.Tensor) -> Optional[PackedWeight]:
    return PackedWeight(weight) if can_pack(weight) else None


def pack_linear_weights(model: nn.Module, pack: Pack = pack_if_possible) -> int:
    """Pack the weight of every module of ``model`` with a ``pack_weights`` method through
    ``pack`` (once the checkpoint is loaded: later writes to a dense weight would not reach its
    packed copy). Returns how many modules packed theirs."""
    return sum(bool(module.pack_weights(pack)) for module in model.modules()
               if hasattr(module, "pack_weights"))


def packed_weights(model: nn.Module) -> List[Packed]:
    """The packed copy of every module of ``model`` that holds one (its ``packed``, which
    ``pack_weights`` sets)."""
    return [module.packed for module in model.modules()
            if getattr(module, "packed", None) is not None]


def warm_up_linears(model: nn.Module, max_rows: int, dtype: torch.dtype) -> int:
    """`PackedWeight.warm_up` for one packed weight of each shape in ``model`` (oneDNN keeps a
    kernel per shape and row count, whichever weight it ran for); returns the calls made."""
    by_shape: Dict[Tuple[int, int], Packed] = {}
    for packed in packed_weights(model):
        by_shape.setdefault((packed.out_features, packed.in_features), packed)
    return sum(packed.warm_up(max_rows, dtype) for packed in by_shape.values())


def dense_or_packed(x: torch.Tensor, weight: torch.Tensor, packed: Optional[Packed],
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``packed`` when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return packed.linear(x, bias)
