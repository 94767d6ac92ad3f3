"""Prefill attention on CPU in bf16: a C kernel (``kv/attention/csrc/prefill_bf16.c``) called
through ctypes, its products on AMX tiles where the CPU has them, else on AVX-512 BF16 dot
products.

Why: torch's CPU flash kernel, which SDPA calls, multiplies a prompt's queries and keys in small
blocks through its generic GEMM; AMX's tiles, or AVX-512 BF16's dot products over operands packed
once per call, do those products several times faster (docs/benchmarks/cpu-bf16.md). The kernel
also reads each key and value row where it lies in the paged cache, where the PyTorch path
gathers them first.

What it computes: a sequence's chunk of new queries over the keys its queries see, causal, after
any cached prefix every query sees (`PrefillSlice.num_prefix_keys`); scores and softmax in fp32,
the probabilities rounded to bf16 for their product with the values (as flash's does), fp32 sums,
each output rounded to bf16 once. Within bf16 rounding of SDPA, not bitwise equal to it.

When it runs: the ``torch`` attention backend's prefills in bf16 on CPUs with AMX (``amx_bf16``
and ``amx_tile``) or AVX-512 BF16 (``avx512_bf16``), head dims 64 and 128, caches ``[slots, Hkv,
D]`` contiguous, where no sliding window cuts the keys. Anything else takes SDPA. The library is
compiled at first use (``$CC``, ``-march=native``), cached under tpserve's cache root
(`kv.native_build`), and checked against SDPA on small inputs before use; where that fails, or
``TPSERVE_CPU_KERNELS=0``, a log line says so and SDPA runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from kv.attention.metadata import PrefillSlice
from kv.native_build import KernelBuildError, build_shared, switched_off

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "prefill_bf16.c"
HEADER = SOURCE.with_name("bf16_avx512.h")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
SWITCH_ENV = "TPSERVE_CPU_KERNELS"
HEAD_DIMS = (64, 128)  # what the kernel takes (on AMX its query block stays in four tiles)
# What the products run on (`parallel.cpu_capability.bf16_path`'s names); "avx512_bf16" can be
# built on a CPU with AMX too (TPSERVE_PREFILL_AVX512), which the tests use to check both.
PRODUCTS = ("amx", "avx512_bf16")
# The most keys a prefill may see on the kernel: it packs every key and value of the call at once
# (2 * Hkv * keys * D bf16: 32 MiB for 8 KV heads of 128 at this bound, plus 16 * keys fp32
# scores a thread). Past it SDPA runs, whose tiles keep its memory flat.
MAX_KEYS = 8192

_P = ctypes.c_void_p
_I = ctypes.c_int64


class PrefillKernel:
    """The loaded library, set up for this process (on AMX: the tile state granted)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.tpserve_prefill_products.restype = ctypes.c_char_p
        self.products = lib.tpserve_prefill_products().decode()
        status = lib.tpserve_prefill_setup()
        if status != 0:
            raise KernelBuildError(f"Linux refused this process the AMX tile state "
                                   f"(arch_prctl ARCH_REQ_XCOMP_PERM returned {status})")
        self._attend = lib.tpserve_prefill_attention_bf16
        self._attend.argtypes = [_P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P,
                                 _I, ctypes.c_int]
        self._attend.restype = ctypes.c_int

    @staticmethod
    def accepts(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the kernel takes this step's prefills: bf16 on CPU, a head dim it takes, rows
        of contiguous heads and contiguous caches."""
        head_dim = query.shape[-1]
        return (query.device.type == "cpu" and query.dtype == torch.bfloat16
                and k_cache.dtype == v_cache.dtype == torch.bfloat16 and head_dim in HEAD_DIMS
                and query.stride(2) == 1 and query.stride(1) == head_dim
                and k_cache.is_contiguous() and v_cache.is_contiguous())

    @staticmethod
    def takes(prefill: PrefillSlice) -> bool:
        """Whether the kernel computes this prefill's mask (plain causal, or causal after a
        prefix every query sees: no sliding window cutting the keys) over at most `MAX_KEYS`."""
        return ((prefill.mask is None or prefill.num_prefix_keys > 0)
                and prefill.kv_slots.shape[0] <= MAX_KEYS)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               prefill: PrefillSlice, scale: float, out: torch.Tensor) -> None:
        """Writes the attention of ``query[prefill.start:prefill.end]`` (``[T, H, D]``) into the
        same rows of ``out`` (``[T, H * D]``, contiguous)."""
        num_heads, head_dim = query.shape[1:]
        slots = prefill.kv_slots
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        rows = prefill.end - prefill.start
        if slots.shape[0] != prefill.num_prefix_keys + rows:
            raise ValueError(f"a prefill of {rows} queries after {prefill.num_prefix_keys} prefix "
                             f"keys needs {prefill.num_prefix_keys + rows} key slots, got "
                             f"{slots.shape[0]}")
        status = self._attend(
            query[prefill.start].data_ptr(), query.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.shape[0], slots.data_ptr(), rows, prefill.num_prefix_keys,
            num_heads, k_cache.shape[1], head_dim, scale, out[prefill.start].data_ptr(),
            out.stride(0), torch.get_num_threads())
        if status == -3:
            raise ValueError(f"a prefill's key slots must lie in the cache's {k_cache.shape[0]}: "
                             f"got {slots.min().item()}..{slots.max().item()}")
        if status == -2:
            raise MemoryError(f"the prefill attention kernel could not allocate its scratch for "
                              f"{slots.shape[0]} keys")
        if status != 0:
            raise ValueError(f"the prefill attention kernel refused head dim {head_dim}: it takes "
                             f"{HEAD_DIMS}")


def build_kernel(products: str) -> PrefillKernel:
    """The kernel with its products on ``products`` (of `PRODUCTS`), built (or found built) for
    this CPU, loaded and checked against SDPA. Raises `KernelBuildError` (or `OSError`) where
    it cannot be."""
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {PRODUCTS}, got {products!r}")
    flags = COMPILE_FLAGS + (("-DTPSERVE_PREFILL_AVX512",) if products == "avx512_bf16" else ())
    kernel = PrefillKernel(build_shared(SOURCE, flags, LINK_FLAGS, headers=(HEADER,)))
    if kernel.products != products:
        raise KernelBuildError(f"{kernel.path} was built for {kernel.products}, not {products}")
    check(kernel)
    return kernel


@functools.lru_cache(maxsize=None)
def prefill_kernel() -> Optional[PrefillKernel]:
    """This process's kernel, built or loaded once, its products on what the CPU has (AMX, else
    AVX-512 BF16); None where it cannot run (logged once)."""
    from parallel.cpu_capability import cpu_bf16_support

    if switched_off(SWITCH_ENV):
        logger.info("CPU prefill attention: %s=0, SDPA runs", SWITCH_ENV)
        return None
    products = cpu_bf16_support().path
    if products not in PRODUCTS:
        logger.info("CPU prefill attention: no AMX or AVX-512 BF16 on this CPU, bf16 prefills "
                    "run on SDPA")
        return None
    try:
        kernel = build_kernel(products)
    except (KernelBuildError, OSError) as exc:
        logger.warning("CPU prefill attention: the %s kernel is not used, SDPA runs (slower): "
                       "%s", products, exc)
        return None
    logger.info("CPU prefill attention: %s kernel %s", products, kernel.path)
    return kernel


def reference_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      prefill: PrefillSlice, scale: float) -> torch.Tensor:
    """The kernel's result through fp32 SDPA: ``[rows, H * D]`` in fp32."""
    q = query[prefill.start:prefill.end].float().transpose(0, 1)  # [H, q, D]
    k = k_cache[prefill.kv_slots].float().transpose(0, 1)  # [Hkv, K, D]
    v = v_cache[prefill.kv_slots].float().transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    rows, keys = q.shape[1], k.shape[1]
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(rows, -1)


def check(kernel: PrefillKernel) -> None:
    """Raises `KernelBuildError` unless the kernel is within bf16 rounding of fp32 SDPA on
    grouped heads of both head dims, with and without a cached prefix, over rows and keys that
    do not fill the kernel's tiles."""
    gen = torch.Generator().manual_seed(0)
    for head_dim, rows, prefix in ((64, 37, 0), (128, 21, 45)):
        num_slots, num_kv_heads, num_heads = 160, 2, 6
        k_cache, v_cache = (torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
                            .bfloat16() for _ in range(2))
        query = torch.randn(rows + 3, num_heads, head_dim, generator=gen).bfloat16()
        slots = torch.randperm(num_slots, generator=gen)[:prefix + rows]
        prefill = PrefillSlice(2, 2 + rows, slots, None, prefix)  # the kernel reads no mask
        out = torch.zeros(rows + 3, num_heads * head_dim, dtype=torch.bfloat16)
        kernel.attend(query, k_cache, v_cache, prefill, head_dim ** -0.5, out)
        want = reference_prefill(query, k_cache, v_cache, prefill, head_dim ** -0.5)
        error = (out[2:2 + rows].float() - want).abs().max().item()
        untouched = out[:2].abs().sum().item() + out[2 + rows:].abs().sum().item()
        if not error < 2e-2 or untouched:
            raise KernelBuildError(f"{kernel.path} differs from SDPA by {error:.2e} (head dim "
                                   f"{head_dim}, {prefix} prefix keys) or wrote outside its rows")
