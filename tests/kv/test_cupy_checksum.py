"""The CuPy hasher's Python side on CPU: launch geometry, arguments, batches split at the grid's
limit, the self-test and its refusals, against a stand-in ``cupy`` whose RawKernel runs the
kernel's own loops (CTAs, threads, rows, segments) in Python. What this cannot check is the CUDA
source itself; ``scripts/gpu/tiers.py`` compares the real kernel with the reference."""

import contextlib
import sys
import types

import numpy as np
import pytest
import torch

from kv.integrity import cupy_checksum
from kv.integrity.block_checksum import DeviceHashUnavailable, pool_rows, select_checksum
from kv.integrity.checksum import mix64_checksum
from kv.kv_cache import KVCache, KVCacheSpec

MASK = (1 << 64) - 1


class FakeArray:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def mix(word: int, position: int) -> int:
    x = (word + position * 0x9E3779B97F4A7C15) & MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


class EmulatedKernel:
    """Runs ``tpserve_kv_mix64`` CTA by CTA, thread by thread, as the CUDA source spells it."""

    def __init__(self, source: str, name: str) -> None:
        assert name == "tpserve_kv_mix64" and f"void {name}(" in source
        self.launches = []
        self.corrupt = False  # add 1 to every CTA's sum: a wrong kernel
        self.error = None  # raise this from every launch: a broken device

    def compile(self) -> None:
        pass

    def __call__(self, grid, block, args) -> None:
        rows, offsets, row_stride, words_per_row, out = args
        assert isinstance(row_stride, np.uint64) and isinstance(words_per_row, np.uint32)
        if self.error is not None:
            raise self.error
        self.launches.append((grid, block))
        base = rows.tensor.reshape(-1).numpy()  # the pool's bytes from the base pointer
        offsets, out = offsets.tensor, out.tensor
        per_cta = cupy_checksum._WORDS_PER_CTA
        for z in range(grid[2]):
            for y in range(grid[1]):
                start_byte = y * int(row_stride) + int(offsets[z])
                words = base[start_byte:start_byte + 8 * int(words_per_row)].view("<u8")
                for x in range(grid[0]):
                    start, end = x * per_cta, min(x * per_cta + per_cta, int(words_per_row))
                    partial = 0
                    for thread in range(block[0]):
                        for col in range(start + thread, end, block[0]):
                            partial += mix(int(words[col]), y * int(words_per_row) + 1 + col)
                    total = (int(out[z]) + partial + int(self.corrupt)) & MASK
                    out[z] = total - (1 << 64) if total >= 1 << 63 else total


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` module (CPU tensors as device arrays) and a current-stream stub."""
    kernels = []
    module = types.ModuleType("cupy")
    module.__version__ = "fake"
    module.asarray = FakeArray
    module.cuda = types.SimpleNamespace(
        Device=lambda index: contextlib.nullcontext(),
        Stream=types.SimpleNamespace(from_external=lambda stream: contextlib.nullcontext()))

    def raw_kernel(source, name):
        kernels.append(EmulatedKernel(source, name))
        return kernels[-1]

    module.RawKernel = raw_kernel
    monkeypatch.setitem(sys.modules, "cupy", module)
    stream = types.SimpleNamespace(__cuda_stream__=lambda: (0, 0), cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    cupy_checksum._compiled_kernel.cache_clear()
    cupy_checksum.self_test.cache_clear()
    yield kernels
    cupy_checksum._compiled_kernel.cache_clear()
    cupy_checksum.self_test.cache_clear()


def random_cache(spec: KVCacheSpec) -> KVCache:
    kv = KVCache(spec, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(1)))
    return kv


def reference(kv: KVCache, block_ids):
    rows, row_bytes = pool_rows(kv)
    return [mix64_checksum(rows.numpy()[:, b * row_bytes:(b + 1) * row_bytes])
            for b in block_ids]


def test_one_launch_per_batch_equals_the_reference(fake_cupy):
    # Rows of 2 x 300 x 4 bytes = 300 words: one CTA share; 3 layers -> 6 rows.
    kv = random_cache(KVCacheSpec(3, 6, 2, 3, 100, torch.float32))
    hasher = cupy_checksum.CupyBlockHasher(kv)
    sums = hasher.hash_blocks([5, 0, 3])
    assert [s & MASK for s in sums.tolist()] == reference(kv, [5, 0, 3])
    assert fake_cupy[0].launches == [((1, 6, 3), (256,))]
    assert hasher.hash_blocks([]).shape == (0,) and len(fake_cupy[0].launches) == 1


def test_long_rows_take_several_ctas_and_big_batches_several_launches(fake_cupy, monkeypatch):
    monkeypatch.setattr(cupy_checksum, "_WORDS_PER_CTA", 64)  # the emulator reads it too
    monkeypatch.setattr(cupy_checksum, "_MAX_GRID_Z", 2)
    kv = random_cache(KVCacheSpec(1, 5, 4, 5, 10, torch.float16))  # 50 words per row
    sums = cupy_checksum.CupyBlockHasher(kv).hash_blocks([4, 1, 2, 0, 3])
    assert [s & MASK for s in sums.tolist()] == reference(kv, [4, 1, 2, 0, 3])
    assert [grid for grid, _ in fake_cupy[0].launches] == [(1, 2, 2), (1, 2, 2), (1, 2, 1)]
    monkeypatch.setattr(cupy_checksum, "_WORDS_PER_CTA", 16)
    sums = cupy_checksum.CupyBlockHasher(kv).hash_blocks([2])
    assert [s & MASK for s in sums.tolist()] == reference(kv, [2])
    assert fake_cupy[0].launches[-1][0] == (4, 2, 1)  # ceil(50 / 16) segments per row


def test_the_self_test_passes_a_faithful_kernel_and_refuses_a_wrong_one(fake_cupy):
    kv = random_cache(KVCacheSpec(2, 3, 4, 2, 8, torch.float32))
    assert isinstance(cupy_checksum.load_cupy_hasher(kv), cupy_checksum.CupyBlockHasher)
    cupy_checksum.self_test.cache_clear()
    fake_cupy[0].corrupt = True
    with pytest.raises(DeviceHashUnavailable, match="differs from the numpy reference"):
        cupy_checksum.load_cupy_hasher(kv)
    checksum, why = select_checksum(True, 64, lambda: cupy_checksum.load_cupy_hasher(kv))
    assert checksum.name == "xxh3" and "differs" in why


def test_a_kernel_that_raises_or_does_not_compile_means_host_hashing(fake_cupy, monkeypatch):
    kv = random_cache(KVCacheSpec(2, 3, 4, 2, 8, torch.float32))
    cupy_checksum._compiled_kernel(None).error = RuntimeError("cudaErrorIllegalAddress")
    with pytest.raises(DeviceHashUnavailable, match="cudaErrorIllegalAddress"):
        cupy_checksum.load_cupy_hasher(kv)
    cupy_checksum._compiled_kernel.cache_clear()

    def no_nvrtc(source, name):
        raise RuntimeError("libnvrtc.so.12: cannot open shared object file")

    monkeypatch.setattr(sys.modules["cupy"], "RawKernel", no_nvrtc)
    with pytest.raises(DeviceHashUnavailable, match="could not compile.*libnvrtc"):
        cupy_checksum.CupyBlockHasher(kv)
