"""Decode attention on CPU straight from the paged cache: a C kernel (``kv/attention/csrc/paged_decode.c``)
built with the package and called through ctypes.

Why: the plain-PyTorch decode path (``kv/attention/torch_paged.py``) gathers every key and value a
bucket may see into padded dense tensors, then calls SDPA, whose CPU kernel copies the strided
K/V once more; the kernel reads each slot's key and value rows once, where they lie, for every
query head (the step times: docs/benchmarks/cpu-decode.md).

When it runs: the ``torch`` attention backend's decode-only buckets, on CPU, with fp32 or bf16
queries over caches of the same dtype laid out ``[slots, Hkv, D]`` contiguously. Anything else
(CUDA, fp16, prefills) takes the PyTorch path. bf16 caches are read as bf16 (half the bytes of
fp32) and widened to fp32 tile by tile; queries, scores, softmax and sums are fp32 in both, and a
bf16 query's output is rounded to bf16 once at the end. On CPUs with AVX-512 (bf16: and AVX-512
BF16) an AVX-512 path of the same library runs instead (`DecodeKernel.allow_avx512`): bf16
scores by VDPBF16PS (exact products, fp32 sums). The backend calls `DecodeKernel.attend_rows`,
which reads the step's query rows and writes its output rows in place. The results are fp32 sums in another
order than SDPA's: within 1e-6 of it on unit-scale fp32 inputs, not bitwise equal.

Building: ``setup.py`` compiles it into ``kv/attention/libpaged_decode.so`` (``-O3 -fopenmp
-ffast-math``, ``-march=x86-64-v3`` unless ``TPSERVE_MARCH`` says otherwise), in the wheel and
in an editable install's checkout. Where that library is missing (built without a compiler), was
built from another ``paged_decode.c`` or needs CPU flags this CPU lacks (`kv.native_stamp`), it
is compiled on first use instead by `kv.native_build.build_shared` (``$CC``, default ``cc``) with
``-march=native``, cached under tpserve's cache root, and a warning says so. The loaded kernel is
checked against the PyTorch path on a small input before it is used. If neither can be had, the
check fails, or ``TPSERVE_CPU_KERNELS=0``, a log line says so and decodes take the PyTorch path:
nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from kv.kv_cache import gather_rows
from kv.native_build import (KernelBuildError, build_shared, load_shipped_or_built,
                             switched_off)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
HEADER = SOURCE.with_name("bf16_avx512.h")  # its AVX-512 exp, shared with the prefill kernel
LIBRARY = Path(__file__).with_name("libpaged_decode.so")  # built with the package (setup.py)
# What compiles it at first use where LIBRARY cannot be used (setup.py's flags are portable).
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC")
# Linked without -ffast-math (see the source's comment); libmvec holds the vector expf that
# -ffast-math calls on x86-64 glibc: where the link finds none, it is tried without.
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBRARIES = (("-lmvec",), ())
SWITCH_ENV = "TPSERVE_CPU_KERNELS"
MAX_HEADS = 256  # query heads the kernel takes (MAX_HEADS in the source)




class DecodeKernel:
    """The loaded kernel; ``attend`` computes what ``reference_attend`` does."""

    def __init__(self, path: Path) -> None:
        self.path = path
        library = ctypes.CDLL(str(path))
        self._fns = {torch.float32: library.tpserve_paged_decode_f32,
                     torch.bfloat16: library.tpserve_paged_decode_bf16}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6
                           + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])
        self._rows = library.tpserve_paged_decode_rows
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
                               + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
                               + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
                               + [ctypes.c_int64] * 2)
        self._set_avx512 = library.tpserve_paged_decode_set_avx512
        self._set_avx512.restype = ctypes.c_int
        self._set_avx512.argtypes = [ctypes.c_int]

    def allow_avx512(self, allowed: bool) -> bool:
        """Let later calls take the kernel's AVX-512 path where the CPU has it (True, the
        default), or keep them on its portable path (False); returns the previous setting."""
        return bool(self._set_avx512(int(allowed)))

    def accepts(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """True for fp32 or bf16 CPU queries over contiguous CPU caches ``[slots, Hkv, D]`` of
        the query's dtype."""
        return (query.device.type == "cpu" and query.dtype in self._fns
                and query.shape[1] <= MAX_HEADS
                and all(c.dtype == query.dtype and c.device.type == "cpu" and c.is_contiguous()
                        for c in (k_cache, v_cache)))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor, valid: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """``q`` ``[B, Hkv, G, D]`` (one query per sequence), caches ``[slots, Hkv, D]``, ``slots``
        ``[B, K]`` (the cache slot of each key), ``valid`` ``[B, K]`` bool (None: every key);
        the caches must be ones it `accepts`. Returns ``[B, Hkv, G, D]``: each row's
        softmax-weighted values over the keys it sees. A seen key's slot outside the caches
        raises IndexError (nothing is read there)."""
        num_seqs, num_kv_heads, group, head_dim = q.shape
        dtype = q.dtype
        q = q.to(torch.float32).contiguous()  # [B, Hkv, G, D], fp32 for either cache dtype
        slots, valid = _kernel_keys(slots, valid)
        out = torch.empty_like(q)
        if num_seqs == 0:
            return out.to(dtype)
        status = self._fns[dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), None if valid is None else valid.data_ptr(),
                          k_cache.shape[0], num_seqs, slots.shape[1], num_kv_heads, group,
                          head_dim, scale, torch.get_num_threads(), out.data_ptr())
        _check_status(status, k_cache.shape[0], lambda: ValueError(
            f"paged decode kernel refused q {tuple(q.shape)}, slots {tuple(slots.shape)} "
            f"(needs at least one key, at most {MAX_HEADS} query heads)"))
        return out.to(dtype)

    def attend_rows(self, query: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slots: torch.Tensor, valid: Optional[torch.Tensor],
                    scale: float, out: torch.Tensor) -> None:
        """`attend` for the decodes of a flat batch, read and written in place: row ``rows[b]``
        of ``query`` ``[T, H, D]`` (each token's heads side by side) attends over sequence b's
        ``slots[b]``/``valid[b]`` and its ``[H * D]`` output goes to that row of ``out``
        ``[T, H * D]`` (contiguous, the query's dtype). Raises IndexError for a slot outside the
        caches or a row outside the batch."""
        num_tokens, num_heads, head_dim = query.shape
        if query.stride(2) != 1 or query.stride(1) != head_dim:
            query = query.contiguous()
        rows = rows.to(torch.int64).contiguous()
        slots, valid = _kernel_keys(slots, valid)
        num_seqs, num_kv_heads = rows.shape[0], k_cache.shape[1]
        if num_seqs == 0:
            return
        status = self._rows(query.data_ptr(), query.stride(0), rows.data_ptr(), num_tokens,
                            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                            None if valid is None else valid.data_ptr(), k_cache.shape[0],
                            num_seqs, slots.shape[1], num_kv_heads, num_heads // num_kv_heads,
                            head_dim, scale, torch.get_num_threads(), out.data_ptr(),
                            out.stride(0), query.element_size())
        _check_status(status, k_cache.shape[0], lambda: IndexError(
            f"paged decode kernel refused rows {tuple(rows.shape)} of a batch of {num_tokens} "
            f"(each must be in it), slots {tuple(slots.shape)} (at least one key)"))


def _kernel_keys(slots: torch.Tensor, valid: Optional[torch.Tensor]
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``slots`` and ``valid`` as the kernel reads them: contiguous int64 and bool."""
    slots = slots.to(torch.int64).contiguous()
    return slots, None if valid is None else valid.to(torch.bool).contiguous()


def _check_status(status: int, num_slots: int, refused: Callable[[], Exception]) -> None:
    """Raise for a kernel's non-zero status: -2 a slot outside the caches' ``num_slots``, any
    other ``refused()``."""
    if status == -2:
        raise IndexError(f"paged decode kernel: a slot outside the cache's {num_slots} slots")
    if status != 0:
        raise refused()


def reference_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, valid: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """The kernel's result through PyTorch, and the decodes' path where the kernel does not run
    (``kv/attention/torch_paged.py``): whole cache rows gathered into padded ``[B, Hkv, K, D]`` K/V,
    then SDPA under the mask (shapes as ``attend``)."""
    k = gather_rows(k_cache, slots).transpose(1, 2)  # [B, Hkv, K, D]
    v = gather_rows(v_cache, slots).transpose(1, 2)
    mask = None if valid is None else valid[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@functools.lru_cache(maxsize=None)
def decode_kernel() -> Optional[DecodeKernel]:
    """This process's kernel, built or loaded once; None where it cannot run (logged once)."""
    if switched_off(SWITCH_ENV):
        logger.info("CPU decode attention: %s=0, the PyTorch path runs", SWITCH_ENV)
        return None
    try:
        kernel, why_built = load_shipped_or_built(LIBRARY, (SOURCE, HEADER), DecodeKernel,
                                                   build)
        check(kernel)
    except (KernelBuildError, OSError) as exc:
        logger.warning("CPU decode attention: the C kernel is not used, the PyTorch path runs "
                       "(slower): %s", exc)
        return None
    if why_built:
        logger.warning("CPU decode attention: %s; the C kernel was compiled for this machine at "
                       "first use instead: %s", why_built, kernel.path)
    else:
        logger.info("CPU decode attention: C kernel %s", kernel.path)
    return kernel


def build(cache_dir: Optional[Path] = None) -> Path:
    """The kernel compiled at first use, where `LIBRARY` cannot be used: its path, compiling it
    unless a build for this source, compiler and CPU is cached. Raises `KernelBuildError` naming
    the command and its error."""
    return build_shared(SOURCE, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBRARIES, cache_dir,
                        headers=(HEADER,))


def check(kernel: DecodeKernel) -> None:
    """Raises `KernelBuildError` unless the kernel equals the PyTorch path on a small input that
    crosses the kernel's tiles and parts, with masked keys and grouped query heads: in fp32, and
    over the same input's bf16 caches (within bf16's rounding of the output)."""
    gen = torch.Generator().manual_seed(0)
    num_seqs, num_kv_heads, group, head_dim, num_keys, num_slots = 3, 2, 4, 64, 1100, 4096
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=gen)
    slots = torch.randint(0, num_slots, (num_seqs, num_keys), generator=gen)
    valid = torch.rand(num_seqs, num_keys, generator=gen) < 0.8
    valid[:, 0] = True
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        k, v, query = (t.to(dtype) for t in (k_cache, v_cache, q))
        got = kernel.attend(query, k, v, slots, valid, head_dim ** -0.5).float()
        want = reference_attend(query.float(), k.float(), v.float(), slots, valid,
                                head_dim ** -0.5)
        error = (got - want).abs().max().item()
        if not error < tolerance:
            raise KernelBuildError(f"{kernel.path} differs from PyTorch's SDPA by {error:.2e} "
                                   f"over {dtype} caches")
