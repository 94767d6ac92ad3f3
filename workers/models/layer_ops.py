"""The elementwise work of a decoder layer, behind one interface with two implementations, chosen
once per model (`layer_ops`):

- ``TorchLayerOps`` (CPU, and CUDA when asked): PyTorch expressions, the same ones
  ``transformers`` runs, so fp32 activations on CPU equal its bit for bit.
- ``TritonLayerOps`` (the CUDA default): one Triton kernel each for residual add + RMSNorm,
  SiLU-and-multiply, and RoPE of q and k with the paged K/V cache write
  (``workers/models/triton_layer_kernels.py``, ``kv/attention/triton_rope_write.py``). They round
  where the expressions round; only the order of RMSNorm's sum of squares differs.

Both carry the residual as vLLM does: a layer takes ``(hidden, residual)`` and its norm returns
``(RMSNorm(hidden + residual), hidden + residual)``, so each add rides in the norm after it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from kv.kv_cache import write_kv
from workers.models.rope import RotaryEmbedding

_RMS_NORM = getattr(F, "rms_norm", None)  # torch >= 2.4
QKV = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``transformers``' ``LlamaRMSNorm``: the row normalised in fp32, rounded to the dtype,
    then scaled by ``weight``."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and _RMS_NORM is not None:
        # On CPU torch's rms_norm is the expression below, bit for bit, in one call: 8
        # dispatched ops fewer, 2 per layer, on a decode step that dispatches thousands.
        return _RMS_NORM(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class TorchLayerOps:
    """The PyTorch expressions."""

    name = "torch"

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(RMSNorm(x + residual), x + residual)``, or ``(RMSNorm(x), x)`` without one."""
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, eps), x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` ``[T, I]`` of the packed ``[T, 2 I]`` projection output."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_write_kv(self, qkv: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> QKV:
        """q ``[T, H, D]`` and k ``[T, Hkv, D]`` of ``qkv`` rotated by ``tables`` (cos, sin
        ``[T, 1, D]``), v; k and v stored at ``slot_mapping`` ``[T]`` of the caches."""
        num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        qk_size = (num_heads + num_kv_heads) * head_dim
        # q and k rotated in one pass: [T, H + Hkv, D]
        qk = RotaryEmbedding.rotate(qkv[:, :qk_size].view(num_tokens, -1, head_dim), tables)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q, k, v


class KernelLayerOps(TorchLayerOps):
    """One kernel call per op: ``layer``'s ``add_rms_norm`` and ``silu_and_mul``, and ``rope``'s
    ``rope_write_kv``, which rotates q and k of a contiguous ``qkv`` in place and writes k and v
    into the caches (the signatures of the methods below)."""

    def __init__(self, layer, rope) -> None:
        self._layer, self._rope = layer, rope

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._layer.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._layer.silu_and_mul(gate_up)

    def rope_write_kv(self, qkv: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> QKV:
        qkv = qkv.contiguous()
        self._rope.rope_write_kv(qkv, tables, k_cache, v_cache, slot_mapping, num_heads,
                                 num_kv_heads)  # q and k rotated in place
        num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        heads = qkv.view(num_tokens, -1, head_dim)  # [T, H + 2 Hkv, D]
        return (heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads],
                heads[:, num_heads + num_kv_heads:])


class TritonLayerOps(KernelLayerOps):
    """One Triton kernel per op; a model's final norm and every layer's use them too."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__(importlib.import_module("workers.models.triton_layer_kernels"),
                         importlib.import_module("kv.attention.triton_rope_write"))


class CpuBf16LayerOps(KernelLayerOps):
    """bf16 on CPU: one C kernel per op (``workers/models/cpu_layer_kernels.py``), rounding where
    the expressions round."""

    name = "cpu-bf16"

    def __init__(self, kernels) -> None:
        super().__init__(kernels, kernels)


LayerOps = TorchLayerOps  # the interface: the others override each method


def fused_kernels_default(device: torch.device, dtype: torch.dtype) -> bool:
    """The one place the choice is made: the Triton kernels on CUDA in 16-bit dtypes (when
    ``triton`` imports); the PyTorch expressions elsewhere. fp32 keeps the expressions on every
    device: its greedy ids must equal ``transformers``' token for token, and the fused norm sums
    its squares in another order."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return importlib.util.find_spec("triton") is not None


def layer_ops(device: torch.device, dtype: torch.dtype,
              fused: Optional[bool] = None) -> TorchLayerOps:
    """The ops a model on ``device`` runs: ``fused`` True forces the Triton kernels (the tests
    run them on CPU under Triton's interpreter), False the PyTorch expressions; None takes
    `fused_kernels_default`, and on CPU in bf16 the C kernels where they load
    (`workers.models.cpu_layer_kernels.layer_kernels`)."""
    if fused is None and device.type == "cpu" and dtype == torch.bfloat16:
        kernels = importlib.import_module("workers.models.cpu_layer_kernels").layer_kernels()
        if kernels is not None:
            return CpuBf16LayerOps(kernels)
    if fused is None:
        fused = fused_kernels_default(device, dtype)
    return TritonLayerOps() if fused else TorchLayerOps()
