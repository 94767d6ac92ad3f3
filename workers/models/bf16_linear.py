"""bf16 linears on CPUs with AVX-512 BF16 and no AMX: a C kernel (``workers/models/csrc/
linear_bf16.c``) over a weight packed once, called through ctypes. `pack_cpu_weight` is the
``pack`` a CPU rank gives `parallel.onednn_linear.pack_linear_weights`.

Why: a decode step multiplies a few rows by every weight of the model, so its linears are bound
by how fast the weights stream from memory. The kernel reads each weight as one sequential
stream, prefetched ahead, at every row count; the figures against oneDNN's bf16 kernels are in
docs/benchmarks/cpu-bf16.md.

What it computes: ``F.linear(x, weight, bias)`` with fp32 sums, each output rounded to bf16 once:
within bf16 rounding of the fp32 product, not bitwise equal to oneDNN's. A row's result depends
on that row alone, not on the other rows, their number or the thread count.

When it runs: bf16 weights ``[out, in]`` with an even ``in`` on a CPU whose bf16 path
(`parallel.cpu_capability.bf16_path`) is ``avx512_bf16``; AMX CPUs keep oneDNN, whose tiles are
faster at many rows. The library is compiled at first use (``$CC``, ``-march=native``), cached
under tpserve's cache root (`kv.native_build`), and checked against an fp32 product before use;
where that fails, or ``TPSERVE_CPU_KERNELS=0``, a log line says so and oneDNN runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Optional

import torch

from kv.native_build import KernelBuildError, build_shared, switched_off
from parallel.onednn_linear import Packed, can_pack, pack_if_possible

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "linear_bf16.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
SWITCH_ENV = "TPSERVE_CPU_KERNELS"
PANEL = 32  # output columns per packed panel (the C source's PANEL)
VERSION = 1  # the C source's tpserve_linear_bf16_version()

_P = ctypes.c_void_p
_I = ctypes.c_int64


class LinearKernel:
    """The loaded library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        library = ctypes.CDLL(str(path))
        self._linear = library.tpserve_linear_bf16
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = [_P, _I, _I, _P, _I, _I, _P, _P, _I, ctypes.c_int]
        version = library.tpserve_linear_bf16_version()
        if version != VERSION:
            raise KernelBuildError(f"{path} is version {version}, this code needs {VERSION}")

    def linear(self, rows: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``rows`` ``[T, in]`` (bf16, unit stride along ``in``) times the weight `pack` made:
        ``[T, out_features]`` bf16."""
        if rows.dtype != torch.bfloat16 or rows.dim() != 2:
            raise ValueError(f"the bf16 linear kernel takes 2-d bf16 rows, got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        status = self._linear(rows.data_ptr(), rows.shape[0], rows.stride(0), packed.data_ptr(),
                              rows.shape[1], out_features,
                              None if bias is None else bias.data_ptr(), out.data_ptr(),
                              out_features, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"the bf16 linear kernel refused rows {tuple(rows.shape)} "
                             f"(stride {rows.stride(0)}) for {out_features} outputs")
        return out


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` (bf16, ``in`` even) in the kernel's layout: ``[ceil(out / 32),
    in / 2, 32, 2]``, the last panel's missing outputs zero."""
    out_features, in_features = weight.shape
    if in_features % 2:
        raise ValueError(f"the bf16 linear kernel needs an even input size, got {in_features}")
    panels = -(-out_features // PANEL)
    padded = torch.zeros(panels * PANEL, in_features, dtype=torch.bfloat16)
    padded[:out_features].copy_(weight.detach())
    return padded.view(panels, PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def accepts(weight: torch.Tensor) -> bool:
    """True when ``weight`` is one the kernel takes (bf16 ``[out, in]`` on CPU, ``in`` even)."""
    return (weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)


class KernelWeight:
    """``weight`` packed for the kernel; ``linear(x, bias)`` is ``F.linear``'s result for ``x``
    ``[..., in]`` within bf16 rounding. Holds the packed copy beside the dense weight."""

    def __init__(self, weight: torch.Tensor, kernel: LinearKernel) -> None:
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.packed = pack(weight)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self.kernel.linear(rows, self.packed, self.out_features, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def warm_up(self, max_rows: int, dtype: torch.dtype) -> int:
        """Nothing to build per row count: one call, which pages the packed copy in."""
        self.linear(torch.zeros(1, self.in_features, dtype=dtype))
        return 1


def build_kernel(cache_dir: Optional[Path] = None) -> LinearKernel:
    """The kernel built (or found built) for this CPU, loaded and checked. Raises
    `KernelBuildError` (or `OSError`) where it cannot be."""
    kernel = LinearKernel(build_shared(SOURCE, COMPILE_FLAGS, LINK_FLAGS, cache_dir=cache_dir))
    check(kernel)
    return kernel


def check(kernel: LinearKernel) -> None:
    """Raises `KernelBuildError` unless the kernel equals an fp32 product within bf16 rounding on
    inputs that cross its panels and row passes (a partial last panel, rows past 8, a bias)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(11, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(70, generator=gen).to(torch.bfloat16)
    want = x.float() @ weight.float().T + bias.float()
    got = kernel.linear(x, pack(weight), 70, bias).float()
    error = ((got - want).abs() / want.abs().clamp_min(1.0)).max().item()
    if not error <= 2 ** -8:
        raise KernelBuildError(f"{kernel.path} differs from an fp32 product by {error:.2e} "
                               "(relative), past bf16 rounding")


@functools.lru_cache(maxsize=None)
def linear_kernel() -> Optional[LinearKernel]:
    """This process's kernel where bf16 linears take it (AVX-512 BF16, no AMX), built or loaded
    once; None where they keep oneDNN (logged once)."""
    from parallel.cpu_capability import cpu_bf16_support

    if switched_off(SWITCH_ENV):
        logger.info("bf16 linears: %s=0, oneDNN runs them", SWITCH_ENV)
        return None
    if cpu_bf16_support().path != "avx512_bf16":
        return None
    try:
        kernel = build_kernel()
    except (KernelBuildError, OSError) as exc:
        logger.warning("bf16 linears: the AVX-512 BF16 kernel is not used, oneDNN runs them "
                       "(slower at a few rows): %s", exc)
        return None
    logger.info("bf16 linears: AVX-512 BF16 kernel %s", kernel.path)
    return kernel


def pack_cpu_weight(weight: torch.Tensor) -> Optional[Packed]:
    """The packed copy ``weight``'s linears run on here: the kernel's where it takes the weight
    and runs on this CPU (`linear_kernel`), else oneDNN's (`pack_if_possible`); None where
    neither can (``TPSERVE_ONEDNN_LINEAR=0`` too)."""
    if not can_pack(weight):
        return None
    if accepts(weight):
        kernel = linear_kernel()
        if kernel is not None:
            return KernelWeight(weight, kernel)
    return pack_if_possible(weight)
