"""Tier copies section of ``scripts/gpu_check.py``: ``scripts/check_cuda_tiers.py``'s own
``check_copies`` (spill to and restore from a pinned host buffer on the tier's copy stream through
the staging buffer, GB/s against a plain ``copy_`` of the same bytes, bytes equal after the round
trip, a flipped host byte caught by the checksum, one gather or scatter kernel and one copy per
chunk of the staging buffer for a batch of consecutive slots), which checksum the tiers chose (mix64 on the device with CuPy, else
xxh3 on the host), the host checksums' own rates (xxh3 and the numpy mix64 reference, one thread,
over as many 720 KiB blocks), and the CuPy kernel (``gpu_check_device_checksum``: equal to the
reference, its GB/s, corruption caught on the device path; "cupy not installed" when it is not).
"""

from __future__ import annotations

import time

import torch

from scripts import check_cuda_tiers
from scripts.gpu.common import CheckContext, Report
from scripts.gpu.device_checksum import check_device_checksum
from kv.integrity.checksum import block_checksum, mix64_checksum

CHECKSUM_BLOCK_BYTES = 720 << 10  # SmolLM2-135M's KV block at TP 1


def checksum_gbps(num_blocks: int, repeats: int = 3, checksum=block_checksum) -> float:
    """``checksum`` over ``num_blocks`` blocks of host memory, one thread, best of ``repeats``."""
    data = torch.randint(0, 256, (num_blocks, CHECKSUM_BLOCK_BYTES), dtype=torch.uint8).numpy()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for row in data:
            checksum(row)
        best = min(best, time.perf_counter() - started)
    return num_blocks * CHECKSUM_BLOCK_BYTES / best / 1e9


def check_tier_copies(ctx: CheckContext, report: Report) -> None:
    blocks = ctx.args.blocks or (8 if ctx.quick else 256)
    result = check_cuda_tiers.check_copies(ctx.device, blocks)
    if ctx.is_cuda:
        report.check("host buffer pinned (one cudaHostRegister)", result["pinned"])
    report.check("spill ok", result["spill_ok"])
    report.check("restore equals the spilled bytes", result["restore_equal"])
    report.check("flipped byte caught by the checksum", result["corruption_caught"])
    report.check("one kernel and one copy per staging chunk", result["batched"])
    report.figure("tier_checksum", f"{result['checksum']} on the "
                  f"{'device' if result['checksum_on_device'] else 'host'}")
    report.figure("blocks", blocks)
    report.figure("staging_blocks", result["staging_blocks"],
                  f"blocks ({result['staging_mib']:.1f} MiB on the device)")
    for key in ("spill_kernels", "spill_copies", "restore_kernels", "restore_copies"):
        report.figure(key, result[key], f"per batch of {blocks} blocks")
    for key in ("d2h_gbps", "h2d_gbps", "plain_d2h_gbps", "plain_copy_gbps"):
        report.figure(key, result[key], "GB/s (best of 3 after a warm-up)")
    report.figure("d2h_vs_plain", result["d2h_gbps"] / result["plain_d2h_gbps"])
    report.figure("h2d_vs_plain", result["h2d_gbps"] / result["plain_copy_gbps"])
    report.figure("checksum_gbps", checksum_gbps(blocks), "GB/s (xxh3, one thread)")
    report.figure("mix64_host_gbps", checksum_gbps(blocks, checksum=mix64_checksum),
                  "GB/s (numpy mix64 reference, one thread: disk reads on the device path)")
    check_device_checksum(ctx, report, blocks)
