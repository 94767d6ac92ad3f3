"""The checksum strategy: which function and where, chosen by device and by what CuPy can do; the
numpy twin of the device kernel hashes strided pool blocks exactly as the host hashes their
copies; CuPy stays optional."""

import logging
import subprocess
import sys

import pytest
import torch

from kv.integrity.block_checksum import (XXH3, DeviceHashUnavailable, ReferenceBlockHasher,
                               choose_block_checksum, index_identity, mix64_strategy, pool_rows,
                               select_checksum)
from kv.integrity.checksum import mix64_checksum
from kv.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=6,
                   dtype=torch.float16)


def random_cache(with_scratch_block: bool = False) -> KVCache:
    kv = KVCache(SPEC, torch.device("cpu"), with_scratch_block=with_scratch_block)
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(0)))
    return kv


# The Triton backend (CUDA's default) gives its pool a scratch block after the last one: the rows
# are one block longer than num_blocks blocks, and the block size must not be derived from them.
@pytest.mark.parametrize("with_scratch_block", [False, True])
def test_reference_hasher_equals_the_host_hash_of_each_block_copy(with_scratch_block):
    kv = random_cache(with_scratch_block)
    rows, row_bytes = pool_rows(kv)
    assert row_bytes == 4 * 2 * 6 * 2 and rows.shape == (6, (5 + with_scratch_block) * row_bytes)
    bs = SPEC.block_size
    sums = ReferenceBlockHasher(kv).hash_blocks([3, 0, 4])
    assert sums.dtype == torch.int64 and sums.shape == (3,)
    for block, value in zip([3, 0, 4], sums.tolist()):
        copy = kv.data[:, :, block * bs:(block + 1) * bs].contiguous()  # what a host slot holds
        assert value & (2**64 - 1) == mix64_checksum(copy.view(torch.uint8).view(-1).numpy())
    assert ReferenceBlockHasher(kv).hash_blocks([]).shape == (0,)


class FakeHasher:
    def hash_blocks(self, block_ids):
        return torch.zeros(len(block_ids), dtype=torch.int64)


def unavailable():
    raise DeviceHashUnavailable("CuPy is not installed")


def test_select_by_device_row_size_and_cupy():
    hasher = FakeHasher()
    assert select_checksum(False, 96, lambda: hasher)[0] is XXH3  # CPU: never the kernel
    checksum, why = select_checksum(True, 96, lambda: hasher)
    assert checksum.name == "mix64" and checksum.device is hasher
    assert checksum.host is mix64_checksum and "device" in why
    checksum, why = select_checksum(True, 96, unavailable)
    assert checksum is XXH3 and "CuPy is not installed" in why
    checksum, why = select_checksum(True, 100, lambda: hasher)
    assert checksum is XXH3 and "100 bytes, not a multiple of 8" in why


def test_a_cpu_pool_gets_xxh3_in_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="kv.integrity.block_checksum"):
        assert choose_block_checksum(random_cache()) is XXH3
    assert [r.getMessage() for r in caplog.records] == [
        "KV block checksums: xxh3 (CPU pool: hashed by the copier threads as they copy)"]


def test_index_identity_names_the_function_except_xxh3():
    assert index_identity("m/rank0", "xxh3") == "m/rank0"
    assert index_identity("m/rank0", "mix64") == "m/rank0#checksum=mix64"
    assert mix64_strategy(FakeHasher()).name == "mix64"


def test_without_cupy_the_loader_says_what_to_install(monkeypatch):
    from kv.integrity import cupy_checksum

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(DeviceHashUnavailable, match="cupy-cuda12x or cupy-cuda13x"):
        cupy_checksum._import_cupy()


def test_importing_the_kv_package_does_not_import_cupy():
    code = ("import sys, kv.tiers.transfer, kv.tiers.block_copier, kv.integrity.cupy_checksum; "
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kernel_source_is_the_reference_formula():
    """The kernel's constants are the reference's (the GPU check compares their results)."""
    from kv.integrity import checksum, cupy_checksum

    source = cupy_checksum.KERNEL_SOURCE
    for constant in (checksum._GOLDEN, checksum._MUL1, checksum._MUL2):
        assert f"{int(constant):#X}ULL".replace("0X", "0x") in source
    for shift in (">> 30", ">> 27", ">> 31"):
        assert shift in source
    assert "WORDS_PER_CTA" not in source and "atomicAdd" in source
