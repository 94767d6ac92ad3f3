"""Device checksums in the tier copies section of ``scripts/gpu_check.py``: the CuPy kernel
(``kv/integrity/cupy_checksum.py``) against its numpy reference on random blocks, its GB/s, and the whole
device-hashed tier path on the GPU (spill hashed on the device, disk round trip verified on the
host by the numpy reference, restore verified on the device; flipped bytes in a host slot and on
disk caught). Without CuPy it says "cupy not installed" (not available), not a failure; on CPU
the kernel cannot run at all (not available either).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List

import torch

from scripts.gpu.common import CheckContext, Report, free_device_memory
from kv.integrity.checksum import DeviceHashUnavailable, pool_rows
from kv.integrity.checksum import mix64_checksum
from kv.tiers.disk.store import DiskStore
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache, KVCacheSpec
from kv.tiers.ops import OpStatus, ReadDisk, Restore, Spill, WriteDisk
from kv.tiers.transfer import TransferEngine

TIMING_BLOCKS = 8192  # of SmolLM2-135M's 720 KiB fp32 blocks: 5.9 GB on the device

OK, CHECKSUM = OpStatus.OK, OpStatus.CHECKSUM


def check_device_checksum(ctx: CheckContext, report: Report, num_blocks: int) -> None:
    if not ctx.is_cuda:
        report.unavailable("device_checksum", "the CuPy kernel needs a CUDA device")
        return
    try:
        import cupy
    except ImportError as exc:
        report.unavailable("device_checksum", f"cupy not installed ({exc}); pip install "
                                              f"cupy-cuda12x or cupy-cuda13x")
        return
    from kv.integrity.cupy_checksum import load_cupy_hasher

    report.figure("cupy", cupy.__version__)
    # SmolLM2-135M's 720 KiB block at TP 1 in fp32, and a bf16 pool whose rows are two CTA shares
    # and 256 words: the kernel's share boundaries and a different dtype.
    for spec in (KVCacheSpec(30, num_blocks, 16, 3, 64, torch.float32),
                 KVCacheSpec(4, 16, 16, 8, 136, torch.bfloat16)):
        kv = random_pool(spec, ctx.device)
        try:
            hasher = load_cupy_hasher(kv)
        except DeviceHashUnavailable as exc:
            report.check("CuPy kernel compiles and passes its self-test", False, str(exc))
            return
        order = torch.randperm(spec.num_blocks).tolist()
        got = [s & 0xFFFFFFFFFFFFFFFF for s in hasher.hash_blocks(order).cpu().tolist()]
        report.check(f"kernel == numpy reference, {spec.num_blocks} random blocks of "
                     f"{spec.bytes_per_block >> 10} KiB ({spec.dtype})",
                     got == host_reference(kv, order))
    # Timed on a pool large enough (8,192 such blocks, 5.9 GB) that the kernel, not the call's
    # host work (the block-id tensor, the launch: ~0.1-0.2 ms), sets the figure.
    timing_spec = KVCacheSpec(30, TIMING_BLOCKS, 16, 3, 64, torch.float32)
    report.figure("device_checksum_gbps",
                  device_gbps(load_cupy_hasher(random_pool(timing_spec, ctx.device)), timing_spec),
                  f"GB/s (one call over {TIMING_BLOCKS} blocks of 720 KiB, host work included)")
    free_device_memory()
    check_tier_path(ctx.device, ctx.workdir / "device_checksum", report)


def random_pool(spec: KVCacheSpec, device: torch.device) -> KVCache:
    kv = KVCache(spec, device)
    flat = kv.data.view(-1).view(torch.uint8)  # every bit pattern, NaNs included
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=device))
    return kv


def host_reference(kv: KVCache, block_ids: List[int]) -> List[int]:
    rows, row_bytes = pool_rows(kv)
    host_rows = rows.cpu().numpy()
    return [mix64_checksum(host_rows[:, b * row_bytes:(b + 1) * row_bytes]) for b in block_ids]


def device_gbps(hasher, spec: KVCacheSpec, repeats: int = 5) -> float:
    """Every block of the hasher's pool in one call, best of ``repeats`` after a warm-up."""
    block_ids = list(range(spec.num_blocks))
    hasher.hash_blocks(block_ids)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        hasher.hash_blocks(block_ids)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return spec.num_blocks * spec.bytes_per_block / best / 1e9


def check_tier_path(device: torch.device, workdir: Path, report: Report) -> None:
    """The engine's own transfer path with device hashing, corruption injected on host and disk
    (runs on CPU too when the test hands the engine the kernel's numpy twin)."""
    spec = KVCacheSpec(4, 16, 16, 8, 64, torch.bfloat16)
    kv = random_pool(spec, device)
    host = HostBuffer(8, spec.bytes_per_block, pin=device.type == "cuda")
    workdir.mkdir(parents=True, exist_ok=True)
    disk = DiskStore(workdir / "slots.bin", 8, host.slot_bytes)
    transfer = TransferEngine(kv, host, disk, wait_timeout_s=60.0)  # stuck: fail in a minute
    bs = spec.block_size
    originals = kv.data[:, :, :4 * bs].clone()
    try:
        report.check("tier engine chose mix64 on the device", transfer.checksum.name == "mix64"
                     and transfer.checksum.device is not None, transfer.checksum.name)
        statuses = run(transfer, [Spill(b, b, tag=b + 1) for b in range(4)]
                       + [WriteDisk(b, b, tag=b + 1) for b in range(4)]
                       + [ReadDisk(b, 4 + b, tag=b + 1) for b in range(4)]
                       + [Restore(4 + b, 8 + b, tag=b + 1) for b in range(4)])
        report.check("spill, disk round trip (host-verified), restore (device-verified)",
                     statuses == (OK,) * 16
                     and same_bits(kv.data[:, :, 8 * bs:12 * bs], originals))
        host.slot(4)[-1] ^= 0x01  # the last byte of the block
        _flip_disk_byte(disk, slot=1, offset=123)
        statuses = run(transfer, [Restore(4, 12, tag=1), Restore(5, 13, tag=2),
                                  ReadDisk(1, 6, tag=2)])
        report.check("flipped last byte in a host slot caught on the device, a clean one not",
                     statuses[:2] == (CHECKSUM, OK))
        report.check("flipped disk byte caught by the host's numpy reference",
                     statuses[2] == CHECKSUM)
    finally:
        transfer.close()
        disk.close()
        host.close()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytes equal (random bits hold NaNs, which ``torch.equal`` calls different)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run(transfer: TransferEngine, ops) -> tuple:
    transfer.submit(ops)
    return transfer.agree(None, wait=True).statuses


def _flip_disk_byte(disk: DiskStore, slot: int, offset: int) -> None:
    position = slot * disk.slot_bytes + offset
    with open(disk.path, "r+b") as file:
        file.seek(position)
        byte = file.read(1)[0]
        file.seek(position)
        file.write(bytes([byte ^ 0x01]))
