"""mix64 of KV blocks on a CUDA device: one CuPy ``RawKernel`` launch hashes a batch of blocks in
place in the pool, so host CPUs never hash on the device's transfer path.

CuPy is optional (the ``gpu`` extra leaves the wheel to the user: ``cupy-cuda12x`` or
``cupy-cuda13x``, matching ``torch.version.cuda``); it is imported only here, only when a CUDA
pool asks for it. The kernel is compiled with NVRTC once per process and device, then checked
against the numpy reference (``kv.integrity.checksum.mix64_checksum``) on a few small random blocks:
anything that fails on the way raises ``DeviceHashUnavailable`` with the reason, and the rank
hashes with xxh3 on the host instead.

The grid is ``(segments of a row, rows, blocks)``: a CTA of 256 threads sums the mixed words of
up to 2,048 consecutive words of one row of one block (each thread 8 words, coalesced), reduces
with warp shuffles and adds its partial sum into the block's result with one 64-bit
``atomicAdd``. Wrapping addition is associative and commutative, so the order the CTAs finish
in does not change a bit of the result. Every byte is read once; a 720 KiB block of 60 rows is
60 CTAs. Cost per batch: one small host-to-device copy (the block offsets), one memset, one
launch per 65,535 blocks, all queued on the caller's current torch stream.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from kv.integrity.checksum import DeviceHashUnavailable, pool_rows
from kv.integrity.checksum import mix64_checksum
from kv.kv_cache import KVCache

_THREADS = 256
_WORDS_PER_THREAD = 8
_WORDS_PER_CTA = _THREADS * _WORDS_PER_THREAD
_MAX_GRID_Z = 65535
_KERNEL_NAME = "tpserve_kv_mix64"

KERNEL_SOURCE = r"""
extern "C" __global__ void tpserve_kv_mix64(
        const unsigned char* __restrict__ rows,           // the pool: [num_rows, row_stride]
        const long long* __restrict__ block_offsets,      // [num_blocks]: byte offset in a row
        const unsigned long long row_stride,              // bytes from one row to the next
        const unsigned int words_per_row,                 // 8-byte words of a block's row
        unsigned long long* __restrict__ out) {           // [num_blocks], zeroed by the caller
    const unsigned int row = blockIdx.y;
    const unsigned int block = blockIdx.z;
    const unsigned long long* words = reinterpret_cast<const unsigned long long*>(
        rows + row * row_stride + block_offsets[block]);
    const unsigned long long first = (unsigned long long)row * words_per_row + 1ULL;
    const unsigned int start = blockIdx.x * WORDS_PER_CTA;
    const unsigned int end = min(start + WORDS_PER_CTA, words_per_row);
    unsigned long long sum = 0ULL;
    for (unsigned int col = start + threadIdx.x; col < end; col += blockDim.x) {
        unsigned long long x = words[col] + (first + col) * 0x9E3779B97F4A7C15ULL;
        x ^= x >> 30;
        x *= 0xBF58476D1CE4E5B9ULL;
        x ^= x >> 27;
        x *= 0x94D049BB133111EBULL;
        x ^= x >> 31;
        sum += x;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, offset);
    }
    __shared__ unsigned long long warp_sums[32];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = sum;
    }
    __syncthreads();
    if (warp == 0) {
        sum = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0ULL;
        for (int offset = 16; offset > 0; offset >>= 1) {
            sum += __shfl_down_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0) {
            atomicAdd(out + block, sum);
        }
    }
}
""".replace("WORDS_PER_CTA", f"{_WORDS_PER_CTA}u")


class CupyBlockHasher:
    """``DeviceBlockHasher`` for one CUDA pool: mix64 of whole blocks by the CuPy kernel.

    Guarantees: results bit-identical to ``mix64_checksum`` of the block's bytes on the host
    (checked at load); work queued on the caller's current torch stream, in order with the
    copies queued there. Not thread-safe per instance (the copier calls it from one thread).
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self._cupy = _import_cupy()
        rows, row_bytes = pool_rows(kv_cache)
        if row_bytes % 8 or rows.stride(0) % 8:
            raise DeviceHashUnavailable(f"block rows of {row_bytes} bytes are not a multiple "
                                        f"of 8 bytes")
        self._device = rows.device
        self._row_bytes = row_bytes
        self._row_stride = rows.stride(0)
        self._num_rows = rows.shape[0]
        self._words_per_row = row_bytes // 8
        with self._cupy.cuda.Device(self._device.index):
            self._rows = self._cupy.asarray(rows)  # shares the pool's memory
        self._kernel = _compiled_kernel(self._device.index)

    def hash_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(len(block_ids), dtype=torch.int64, device=self._device)  # [n]
        if not block_ids:
            return out
        offsets = torch.tensor([b * self._row_bytes for b in block_ids], dtype=torch.int64)
        offsets = offsets.to(self._device, non_blocking=True)  # [n]
        cupy = self._cupy
        segments = -(-self._words_per_row // _WORDS_PER_CTA)
        stream = _cupy_stream(cupy, torch.cuda.current_stream(self._device))
        with cupy.cuda.Device(self._device.index), stream:
            for start in range(0, len(block_ids), _MAX_GRID_Z):
                count = min(_MAX_GRID_Z, len(block_ids) - start)
                self._kernel((segments, self._num_rows, count), (_THREADS,),
                             (self._rows, cupy.asarray(offsets[start:]),
                              np.uint64(self._row_stride), np.uint32(self._words_per_row),
                              cupy.asarray(out[start:])))
        return out


def load_cupy_hasher(kv_cache: KVCache) -> CupyBlockHasher:
    """A checked ``CupyBlockHasher`` for this pool, or ``DeviceHashUnavailable`` saying why."""
    self_test(kv_cache.data.device)
    return CupyBlockHasher(kv_cache)


@functools.lru_cache(maxsize=None)
def self_test(device: torch.device) -> None:
    """The kernel against the numpy reference on a few small random pools on ``device`` (odd
    row counts, rows shorter and longer than one CTA's share, blocks hashed out of order);
    raises ``DeviceHashUnavailable`` on any difference or error. Runs once per device."""
    from kv.kv_cache import KVCacheSpec

    generator = torch.Generator().manual_seed(0)
    for shape in ((1, 3, 1, 1, 2), (3, 5, 4, 3, 20), (2, 4, 16, 8, 72)):
        spec = KVCacheSpec(*shape, dtype=torch.float32)
        host_kv = KVCache(spec, torch.device("cpu"))
        host_kv.data.copy_(torch.randn(host_kv.data.shape, generator=generator))
        rows, row_bytes = pool_rows(host_kv)
        order = list(range(spec.num_blocks))[::-1]
        want = [mix64_checksum(rows.numpy()[:, b * row_bytes:(b + 1) * row_bytes])
                for b in order]
        try:
            device_kv = KVCache(spec, device)
            device_kv.data.copy_(host_kv.data)
            got = [s & 0xFFFFFFFFFFFFFFFF
                   for s in CupyBlockHasher(device_kv).hash_blocks(order).cpu().tolist()]
        except DeviceHashUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - any CuPy or CUDA error: hash on the host
            raise DeviceHashUnavailable(f"the CuPy checksum kernel failed: "
                                        f"{type(exc).__name__}: {exc}") from exc
        if got != want:
            raise DeviceHashUnavailable(f"the CuPy checksum kernel differs from the numpy "
                                        f"reference on a {spec} pool")


def _cupy_stream(cupy, stream: torch.cuda.Stream):
    """The torch stream as a CuPy stream (the CUDA stream protocol where both sides speak it:
    CuPy 14 deprecates ``ExternalStream``)."""
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise DeviceHashUnavailable(
            f"CuPy is not installed ({exc}); install the wheel for this CUDA "
            f"(torch.version.cuda={torch.version.cuda}): cupy-cuda12x or cupy-cuda13x") from exc
    return cupy


@functools.lru_cache(maxsize=None)
def _compiled_kernel(index: int):
    """The kernel compiled for device ``index``, once per process."""
    cupy = _import_cupy()
    try:
        with cupy.cuda.Device(index):
            kernel = cupy.RawKernel(KERNEL_SOURCE, _KERNEL_NAME)
            kernel.compile()
    except Exception as exc:  # noqa: BLE001 - NVRTC missing, an unsupported device, ...
        raise DeviceHashUnavailable(f"CuPy {cupy.__version__} could not compile the checksum "
                                    f"kernel: {type(exc).__name__}: {exc}") from exc
    return kernel
