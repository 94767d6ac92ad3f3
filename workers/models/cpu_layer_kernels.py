"""A decoder layer's elementwise ops on CPU in bf16 as C kernels (``workers/models/csrc/layer_ops.c``)
called through ctypes: residual add + RMSNorm, SiLU-and-multiply, RoPE with the K/V cache write;
and the greedy pick over bf16 logits (each row's first maximum).

Why: in bf16 each PyTorch op of these expressions widens to fp32 and rounds back, the layer runs
about 15 of them per step, and on a 2-core host an op big enough for OpenMP waits for the other
core (a ``[64, 1536]`` SiLU took 14x its one-thread time with the other core busy). Each kernel is
one call that rounds where the expressions round (docs/benchmarks/cpu-bf16.md).

When it runs: bf16 models on CPU (`CpuBf16LayerOps`, chosen by `workers.models.layer_ops.layer_ops`)
where the library compiles and passes `check` against the PyTorch expressions; fp32 keeps the
expressions (its ids must equal ``transformers``'). ``TPSERVE_CPU_KERNELS=0`` turns it off with
the decode kernel. The library is compiled at first use (``$CC``, ``-march=native``) and cached
under tpserve's cache root (`kv.native_build`); where that fails, a log line says so and the
expressions run.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
from pathlib import Path
from typing import Optional, Tuple

import torch

from kv.native_build import KernelBuildError, build_shared, switched_off

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "layer_ops.c"
# Its AVX-512 helpers, shared with the prefill attention kernel.
HEADER = Path(__file__).parents[2] / "kv" / "attention" / "csrc" / "bf16_avx512.h"
# No -ffast-math: every op must round as IEEE fp32 does, as PyTorch's do (no contraction into
# FMAs either). x86-64: 512-bit vectors where the CPU has them (GCC prefers 256 otherwise).
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC",
                 f"-I{HEADER.parent}") + (
    ("-mprefer-vector-width=512",) if platform.machine() == "x86_64" else ())
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBRARIES = ((),)
SWITCH_ENV = "TPSERVE_CPU_KERNELS"
MAX_HEAD_DIM = 512  # the RoPE kernel's scratch row (the source's ``rotated``)
MAX_HIDDEN = 16384  # RMSNorm's row (the source's MAX_HIDDEN)
SUM_LANES = (8, 16)  # the vector widths PyTorch's CPU sum may add in (`check` finds which)

_P = ctypes.c_void_p
_I = ctypes.c_int64


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class LayerKernels:
    """The loaded library. Every tensor it takes is a contiguous bf16 CPU tensor (slots int64)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._norm = lib.tpserve_add_rms_norm_bf16
        self._norm.argtypes = [_P, _P, _P, ctypes.c_float, _I, _I, _P, _P, ctypes.c_int,
                               ctypes.c_int]
        self._norm.restype = None
        self._silu = lib.tpserve_silu_mul_bf16
        self._silu.argtypes = [_P, _I, _I, _P, ctypes.c_int]
        self._silu.restype = None
        self._rope = lib.tpserve_rope_write_kv_bf16
        self._rope.argtypes = [_P] * 6 + [_I] * 5 + [ctypes.c_int]
        self._rope.restype = ctypes.c_int
        self._first_max = lib.tpserve_first_max_bf16
        self._first_max.argtypes = [_P, _I, _I, _P, ctypes.c_int]
        self._first_max.restype = None
        self.sum_lanes = SUM_LANES[0]  # RMSNorm's sum order: `check` sets PyTorch's

    def add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                     weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(RMSNorm(x + residual), x + residual)`` of ``[T, H]`` rows (``x`` itself as the sum
        without a residual)."""
        x = x.contiguous()
        num_tokens, hidden = x.shape
        norm = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        if residual is not None:
            residual = residual.contiguous()
        if hidden > MAX_HIDDEN:
            raise ValueError(f"RMSNorm kernel: rows of {hidden} values, at most {MAX_HIDDEN}")
        self._norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), eps, num_tokens, hidden,
                   total.data_ptr(), norm.data_ptr(), self.sum_lanes, torch.get_num_threads())
        return norm, total

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` ``[T, I]`` of ``[T, 2 I]``."""
        gate_up = gate_up.contiguous()
        num_tokens, width = gate_up.shape
        out = gate_up.new_empty(num_tokens, width // 2)
        self._silu(gate_up.data_ptr(), num_tokens, width // 2, out.data_ptr(),
                   torch.get_num_threads())
        return out

    def rope_write_kv(self, qkv: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor],
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> None:
        """q and k of ``qkv`` ``[T, (H + 2 Hkv) D]`` (contiguous) rotated in place by ``tables``
        (cos, sin ``[T, 1, D]``); k and v stored at ``slot_mapping`` of the caches
        ``[slots, Hkv, D]``. Raises IndexError for a slot outside the caches."""
        num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"RoPE kernel: heads of {head_dim}, at most {MAX_HEAD_DIM}")
        cos, sin = (t.reshape(num_tokens, head_dim).contiguous() for t in tables)
        slots = slot_mapping.to(torch.int64).contiguous()
        status = self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                            num_tokens, num_heads, num_kv_heads, head_dim,
                            torch.get_num_threads())
        if status:
            raise IndexError(f"RoPE/KV write kernel: a slot outside the cache's "
                             f"{k_cache.shape[0]} slots")

    def first_max(self, rows: torch.Tensor) -> torch.Tensor:
        """The index of each row's first maximum of ``[N, V]`` (a NaN first), int64: what
        ``rows.max(dim=-1).indices`` gives."""
        rows = rows.contiguous()
        index = torch.empty(rows.shape[0], dtype=torch.int64)
        self._first_max(rows.data_ptr(), rows.shape[0], rows.shape[1], index.data_ptr(),
                        torch.get_num_threads())
        return index


@functools.lru_cache(maxsize=None)
def layer_kernels() -> Optional[LayerKernels]:
    """This process's kernels, built or loaded once; None where they cannot run (logged once)."""
    if switched_off(SWITCH_ENV):
        logger.info("CPU bf16 layer ops: %s=0, the PyTorch expressions run", SWITCH_ENV)
        return None
    try:
        kernels = LayerKernels(build_shared(SOURCE, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBRARIES,
                                            headers=(HEADER,)))
        check(kernels)
    except (KernelBuildError, OSError) as exc:
        logger.warning("CPU bf16 layer ops: the C kernels are not used, the PyTorch expressions "
                       "run (slower): %s", exc)
        return None
    logger.info("CPU bf16 layer ops: C kernels %s", kernels.path)
    return kernels


def check(kernels: LayerKernels) -> None:
    """Raises `KernelBuildError` unless each kernel gives the PyTorch expressions' bf16 values
    (within one bf16 rounding step, where PyTorch's sum order is neither of `SUM_LANES`') on a
    small input."""
    from workers.models.layer_ops import TorchLayerOps  # the expressions (imports this module)

    ref, gen = TorchLayerOps(), torch.Generator().manual_seed(0)
    _find_sum_order(kernels, ref, gen)
    x, res = (torch.randn(5, 64, generator=gen).bfloat16() for _ in range(2))
    weight = torch.rand(64, generator=gen).bfloat16() + 0.5
    pairs = [(kernels.add_rms_norm(x, res, weight, 1e-5), ref.add_rms_norm(x, res, weight, 1e-5)),
             ((kernels.silu_and_mul(torch.cat([x, res], 1)),),
              (ref.silu_and_mul(torch.cat([x, res], 1)),))]
    qkv = torch.randn(5, 4 * 32, generator=gen).bfloat16()  # 2 q heads, 1 KV head of 32
    angles = torch.rand(5, 1, 32, generator=gen)
    tables = (angles.cos().bfloat16(), angles.sin().bfloat16())
    caches = [torch.zeros(8, 1, 32, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([3, 0, 7, 5, 1])
    want = ref.rope_write_kv(qkv.clone(), tables, caches[0], caches[1], slots, 2, 1)
    got = qkv.clone()
    kernels.rope_write_kv(got, tables, caches[2], caches[3], slots, 2, 1)
    pairs.append(((got[:, :96], caches[2], caches[3]),
                  (torch.cat([want[0], want[1]], 1).reshape(5, 96), caches[0], caches[1])))
    scores = torch.randint(-3, 4, (3, 40), generator=gen).bfloat16()  # ties
    scores[2, 7] = float("nan")
    pairs.append(((kernels.first_max(scores),), (scores.max(dim=-1).indices,)))
    for got_values, want_values in pairs:
        for a, b in zip(got_values, want_values):
            error = (a.float() - b.float()).abs().max().item()
            if not error <= 2 ** -7 * max(1.0, b.float().abs().max().item()):
                raise KernelBuildError(f"{kernels.path} differs from the PyTorch expressions "
                                       f"by {error:.2e}")


def _find_sum_order(kernels: LayerKernels, ref, gen: torch.Generator) -> None:
    """Set ``kernels.sum_lanes`` to the width whose RMSNorm equals the expression's on rows with
    outliers (where sum orders part); the first where none does."""
    x = (torch.randn(64, 576, generator=gen)
         * torch.exp(2 * torch.randn(64, 576, generator=gen))).bfloat16()
    weight = torch.ones(576, dtype=torch.bfloat16)
    want = ref.add_rms_norm(x, None, weight, 1e-5)[0]
    for lanes in SUM_LANES:
        kernels.sum_lanes = lanes
        if torch.equal(kernels.add_rms_norm(x, None, weight, 1e-5)[0], want):
            return
    kernels.sum_lanes = SUM_LANES[0]
