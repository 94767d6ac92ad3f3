"""Triton kernels for a decoder layer's elementwise work (the CUDA path; imported only there and
in tests under Triton's interpreter):

- ``add_rms_norm``: ``residual = x + residual`` and ``out = RMSNorm(residual)`` in one pass, one
  program per token (without a residual: the norm alone).
- ``silu_and_mul``: ``silu(gate) * up`` over the packed gate/up projection output.

Both compute in fp32 and round where the PyTorch expressions they replace round
(`workers.models.layer_ops.TorchLayerOps`): the residual sum to the model's dtype, the
normalised row to the model's dtype before the weight multiplies it, ``silu(gate)`` to the
model's dtype before ``up`` multiplies it. So 16-bit results equal the PyTorch ones but for the
order of the row's sum of squares; fp32 results differ from them by that order alone.

Each launch is built apart from running it (``KernelLaunch``) so that
``scripts/check_gpu_kernels.py`` compiles exactly what a step launches.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kv.attention.triton_paged import KernelLaunch

SILU_BLOCK = 1024  # elements of one row's half a silu-and-mul program covers


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """One token's row: ``s = x + residual`` (rounded to the dtype, stored as the new residual),
    then ``weight * (s * rsqrt(mean(s^2) + eps))`` with the normalised row rounded first."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=ok)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, 0) / HIDDEN
    h = (h * tl.rsqrt(mean_square + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0)
    out = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out,
                         SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t, i] = silu(gate[t, i]) * up[t, i]``, gate the first ``SIZE`` columns, up the rest."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < SIZE
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + SIZE + offs, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: expected a [tokens, features] tensor with contiguous rows, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")


def add_rms_norm_launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                        eps: float, out: torch.Tensor,
                        residual_out: Optional[torch.Tensor]) -> KernelLaunch:
    """`add_rms_norm`'s launch into ``out`` (and ``residual_out`` with a residual)."""
    _check_rows("x", x)
    hidden = x.shape[1]
    has_residual = residual is not None
    if has_residual:
        _check_rows("residual", residual)
    r = residual if has_residual else x
    r_out = residual_out if has_residual else out
    block = triton.next_power_of_2(hidden)
    return KernelLaunch(_add_rms_norm_kernel, (x.shape[0],), (
        x, r, weight, out, r_out, eps, x.stride(0), r.stride(0), out.stride(0), r_out.stride(0)),
        dict(HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual,
             num_warps=max(1, min(16, block // 256))))


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual), x + residual)`` for ``x`` ``[T, hidden]``; without a residual,
    ``(RMSNorm(x), x)``. One kernel launch; the inputs are left as they were."""
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else None
    add_rms_norm_launch(x, residual, weight, eps, out, residual_out).launch()
    return out, (residual_out if residual is not None else x)


def silu_and_mul_launch(gate_up: torch.Tensor, out: torch.Tensor) -> KernelLaunch:
    """`silu_and_mul`'s launch into ``out`` ``[T, I]``."""
    _check_rows("gate_up", gate_up)
    size = gate_up.shape[1] // 2
    block = min(SILU_BLOCK, triton.next_power_of_2(size))
    return KernelLaunch(_silu_and_mul_kernel, (gate_up.shape[0], triton.cdiv(size, block)), (
        gate_up, out, gate_up.stride(0), out.stride(0)), dict(SIZE=size, BLOCK=block))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[T, I]`` of the packed ``gate_up`` ``[T, 2 I]``; one launch."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even number of columns (gate, then up), got "
                         f"{gate_up.shape[-1]}")
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    silu_and_mul_launch(gate_up, out).launch()
    return out
