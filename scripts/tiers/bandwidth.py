"""Parts (a) and (b) of ``bench_kv_tiers.py``: the host and disk tiers' bandwidth against plain
copies of the same bytes. See that script's docstring for what is measured; this module holds the
measurements and their report, so the trace replay (c) can live apart.

Fairness of the baselines: each pair (tier, baseline) moves the same bytes with the same threads
available, alternating which of the two runs first from one round to the next (so neither always
runs right after the other's work, e.g. a copy thread pool still spinning or a disk still
flushing). The raw disk loop reads into and writes from the tier's own host buffer: on a VM the
host pages behind two equally touched buffers can move direct I/O at rates 2x apart, which would
measure the pages, not the tier.

Each timed run starts after the same quiet pause (``SETTLE_S``). Without it, whichever path runs
right after a torch ``copy_`` inherits torch's OpenMP workers, which spin on both cores for a few
milliseconds after every parallel region: measured here, the tier's 180 MiB of spills ran at
13.9-14.5 GB/s straight after a ``copy_``, 14.1-16.9 after 3 ms, 18.6-18.8 after 10 ms, against
21.3-22.5 for ``copy_`` itself whatever the pause (``copy_`` never follows spinning workers: the
tier's threads block when done). A pause of 50 ms slowed both (the VM parks an idle vCPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

from kv.integrity.checksum import block_checksum
from kv.tiers.disk.store import DiskStore
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache, KVCacheSpec
from kv.tiers.ops import OpStatus, ReadDisk, Restore, Spill, WriteDisk
from kv.tiers.transfer import TransferEngine
from workers.model_config import ModelConfig

IO_CHUNK_BYTES = 8 << 20  # the raw loop's call size, equal to DiskStore's max_io_bytes
TARGET_COPY_RATIO = 0.8
TARGET_DISK_RATIO = 0.8
SETTLE_S = 0.01  # the quiet pause before each timed run (module docstring)


def kv_spec(model: ModelConfig, num_blocks: int, block_size: int) -> KVCacheSpec:
    """One rank's KV pool shape at TP 1, in fp32 (what the engine uses on CPU)."""
    return KVCacheSpec(num_layers=model.num_layers, num_blocks=num_blocks, block_size=block_size,
                       num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                       dtype=torch.float32)


def _timed(fn: Callable[[], None]) -> float:
    time.sleep(SETTLE_S)
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _run_ops(transfer: TransferEngine, ops: list) -> None:
    transfer.submit(ops)
    results = transfer.agree(None, wait=True)
    bad = [s for s in results.statuses if s is not OpStatus.OK]
    if len(results.statuses) != len(ops) or bad:
        raise RuntimeError(f"{type(ops[0]).__name__} batch: {len(bad)} of {len(ops)} ops failed "
                           f"({sorted({s.name for s in bad})})")


def compare(runs: Dict[str, Tuple[Callable[[], None], ...]], num_bytes: int,
            repeats: int) -> Dict[str, Tuple[float, ...]]:
    """Per direction: median GB/s of each contender (the tier first, then its baselines) after
    one warm-up round. Which contender runs first rotates from one round to the next, and each
    run starts after ``SETTLE_S``."""
    times: Dict[str, List[List[float]]] = {k: [[] for _ in fns] for k, fns in runs.items()}
    for round_index in range(repeats + 1):
        for name, fns in runs.items():
            order = [(round_index + i) % len(fns) for i in range(len(fns))]
            for i in order:
                elapsed = _timed(fns[i])
                if round_index:
                    times[name][i].append(elapsed)
    return {name: tuple(num_bytes / statistics.median(t) / 1e9 for t in per_fn)
            for name, per_fn in times.items()}


def same_buffer_views(kv: KVCache, host: HostBuffer) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pool, host) views of every block as ``[L, 2, blocks, block_size, H, D]``: one ``copy_``
    between them moves exactly the bytes the tier moves, between the same pages, in one call on
    torch's threads, with no checksum."""
    spec = kv.spec
    n = spec.num_blocks
    pool = kv.data[:, :, :n * spec.block_size].view(
        spec.num_layers, 2, n, spec.block_size, spec.num_kv_heads, spec.head_dim)
    slots = host.data[:n, :host.block_nbytes].view(spec.dtype).view(
        n, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return pool, slots.permute(1, 2, 0, 3, 4, 5)


def bench_host_copies(spec: KVCacheSpec, repeats: int) -> Dict[str, Tuple[float, ...]]:
    """Per direction (tier, ``copy_`` between the same buffers, ``copy_`` between two fresh
    contiguous tensors) GB/s."""
    n = spec.num_blocks
    kv = KVCache(spec, torch.device("cpu"))
    kv.data.normal_()
    host = HostBuffer(n, spec.bytes_per_block, pin=False)
    transfer = TransferEngine(kv, host)
    pool, slots = same_buffer_views(kv, host)
    numel = n * spec.bytes_per_block // 4
    src, dst = torch.randn(numel), torch.empty(numel)  # the fresh contiguous fp32 pair
    spills = [Spill(b, b, tag=b) for b in range(n)]
    restores = [Restore(b, b, tag=b) for b in range(n)]
    try:
        return compare({"device_to_host": (lambda: _run_ops(transfer, spills),
                                           lambda: slots.copy_(pool), lambda: dst.copy_(src)),
                        "host_to_device": (lambda: _run_ops(transfer, restores),
                                           lambda: pool.copy_(slots), lambda: src.copy_(dst))},
                       n * spec.bytes_per_block, repeats)
    finally:
        transfer.close()
        host.close()


def bench_checksum(spec: KVCacheSpec, repeats: int) -> float:
    """GB/s of xxh3 alone over the same bytes (one thread, from memory): what the tier adds."""
    host = HostBuffer(spec.num_blocks, spec.bytes_per_block, pin=False)
    try:
        host.data.random_(0, 256)
        views = [host.view(i)[:host.block_nbytes] for i in range(spec.num_blocks)]
        times = [_timed(lambda: [block_checksum(v) for v in views]) for _ in range(repeats + 1)]
        return spec.num_blocks * spec.bytes_per_block / statistics.median(times[1:]) / 1e9
    finally:
        host.close()


class RawDirectFile:
    """The baseline of (b): 8 MiB ``pwrite``/``preadv`` calls on an ``O_DIRECT`` file, from and
    into ``buffer`` (the tier's host buffer: the same pages the tier moves; a read brings back
    the bytes the last write wrote, so the tier's slots keep their bytes and checksums)."""

    def __init__(self, path: Path, buffer: memoryview) -> None:
        self.num_bytes = buffer.nbytes
        self.view = buffer
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            self.fd, self.is_direct = os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError:
            self.fd, self.is_direct = os.open(path, flags, 0o644), False
        os.ftruncate(self.fd, self.num_bytes)

    def write(self) -> None:
        self._loop(lambda view, offset: os.pwrite(self.fd, view, offset))

    def read(self) -> None:
        self._loop(lambda view, offset: os.preadv(self.fd, [view], offset))

    def _loop(self, call: Callable[[memoryview, int], int]) -> None:
        offset = 0
        while offset < self.num_bytes:
            n = call(self.view[offset:min(offset + IO_CHUNK_BYTES, self.num_bytes)], offset)
            if n <= 0:
                raise OSError(f"raw O_DIRECT loop: no progress at byte {offset}")
            offset += n

    def close(self) -> None:
        os.close(self.fd)


def bench_disk(spec: KVCacheSpec, directory: Path, repeats: int) -> Tuple[Dict, bool, bool]:
    """(per direction (tier, raw) GB/s, tier is O_DIRECT, raw loop is O_DIRECT)."""
    n = spec.num_blocks
    kv = KVCache(spec, torch.device("cpu"))
    kv.data.normal_()
    host = HostBuffer(n, spec.bytes_per_block, pin=False)
    disk = DiskStore(directory / "tier_blocks.bin", n, host.slot_bytes)
    transfer = TransferEngine(kv, host, disk)
    raw = RawDirectFile(directory / "raw_direct.bin",
                        memoryview(host.data.numpy().reshape(-1)))
    try:
        _run_ops(transfer, [Spill(b, b, tag=b) for b in range(n)])  # host slots need checksums
        raw.write()  # before any raw read: reads must bring back the slots' own bytes
        writes = [WriteDisk(s, s, tag=s) for s in range(n)]
        reads = [ReadDisk(s, s, tag=s) for s in range(n)]
        result = compare({"write": (lambda: _run_ops(transfer, writes), raw.write),
                          "read": (lambda: _run_ops(transfer, reads), raw.read)},
                         n * host.slot_bytes, repeats)
        return result, disk.is_direct, raw.is_direct
    finally:
        transfer.close()
        disk.close()
        host.close()
        raw.close()


def print_bandwidth(title: str, result: Dict[str, Tuple[float, ...]], base_names: List[str],
                    num_bytes: int, repeats: int) -> Dict[str, float]:
    """The table; returns per direction the tier's ratio to the first baseline (the target's)."""
    print(f"\n{title}: {num_bytes / 2**20:.0f} MiB per batch, median of {repeats} after a warm-up")
    header = "".join(f"{name + ' GB/s':>26}{'ratio':>7}" for name in base_names)
    print(f"  {'direction':<16}{'tier GB/s':>11}{header}")
    ratios = {}
    for name, (tier, *bases) in result.items():
        ratios[name] = tier / bases[0]
        cells = "".join(f"{base:>26.2f}{tier / base:>7.2f}" for base in bases)
        print(f"  {name:<16}{tier:>11.2f}{cells}")
    return ratios


def run_copies(model: ModelConfig, args: argparse.Namespace) -> Dict[str, object]:
    spec = kv_spec(model, args.copy_blocks, args.block_size)
    result = bench_host_copies(spec, args.repeats)
    ratios = print_bandwidth(f"(a) host tier copies ({spec.bytes_per_block / 1024:.0f} KiB per "
                             f"block, xxh3 checksum per block included) vs plain copy_",
                             result, ["copy_ same buffers", "copy_ fresh tensors"],
                             args.copy_blocks * spec.bytes_per_block, args.repeats)
    print(f"  host_copy_ratio = the lower of the two against copy_ between the same buffers: "
          f"{min(ratios.values()):.2f} (the fresh pair's pages can move 1.7x faster or slower "
          f"than the pool's: informational)", flush=True)
    checksum_gbps = bench_checksum(spec, args.repeats)
    print(f"  of which checksums: xxh3 alone over the same bytes runs at {checksum_gbps:.2f} GB/s "
          f"(one thread, from memory); the tier hashes every block it copies, right after the "
          f"copy, on {torch.get_num_threads()} threads", flush=True)
    d2h, h2d = result["device_to_host"], result["host_to_device"]
    return {"host_copy_ratio": min(ratios.values()), "checksum_gbps": checksum_gbps,
            "d2h_gbps": d2h[0], "d2h_copy_gbps": d2h[1], "d2h_fresh_copy_gbps": d2h[2],
            "h2d_gbps": h2d[0], "h2d_copy_gbps": h2d[1], "h2d_fresh_copy_gbps": h2d[2],
            "d2h_ratio": ratios["device_to_host"], "h2d_ratio": ratios["host_to_device"],
            "copy_bytes": args.copy_blocks * spec.bytes_per_block}


def run_disk(model: ModelConfig, args: argparse.Namespace, directory: Path) -> Dict[str, object]:
    spec = kv_spec(model, args.disk_blocks, args.block_size)
    result, tier_direct, raw_direct = bench_disk(spec, directory, args.repeats)
    num_bytes = args.disk_blocks * -(-spec.bytes_per_block // 4096) * 4096
    ratios = print_bandwidth(f"(b) disk tier ({directory}) vs raw O_DIRECT loop of 8 MiB calls",
                             result, ["raw O_DIRECT"], num_bytes, args.repeats)
    print(f"  disk_ratio = the lower of the two: {min(ratios.values()):.2f}; O_DIRECT in use: "
          f"tier {tier_direct}, raw loop {raw_direct}"
          + ("" if tier_direct and raw_direct else " (buffered fallback: page cache numbers)"),
          flush=True)
    return {"disk_ratio": min(ratios.values()),
            "disk_write_gbps": result["write"][0], "disk_write_raw_gbps": result["write"][1],
            "disk_read_gbps": result["read"][0], "disk_read_raw_gbps": result["read"][1],
            "disk_write_ratio": ratios["write"], "disk_read_ratio": ratios["read"],
            "disk_bytes": num_bytes, "disk_is_direct": tier_direct,
            "disk_raw_is_direct": raw_direct}


def bandwidth_verdict(figures: Dict[str, object]) -> Dict[str, object]:
    """The targets of the parts run among (a) and (b), met or not, printed and returned (the
    whole benchmark's ``verdict`` covers them when every part runs)."""
    met = {}
    print("\ntargets:")
    if "host_copy_ratio" in figures:
        met["host_copy_ratio_ge_0.8"] = figures["host_copy_ratio"] >= TARGET_COPY_RATIO
        print(f"  tier copies >= {TARGET_COPY_RATIO:.0%} of plain copy_: "
              f"{figures['host_copy_ratio']:.2f} -> "
              f"{'met' if met['host_copy_ratio_ge_0.8'] else 'NOT met'}")
    if "disk_ratio" in figures:
        met["disk_ratio_ge_0.8"] = figures["disk_ratio"] >= TARGET_DISK_RATIO
        print(f"  disk >= {TARGET_DISK_RATIO:.0%} of raw O_DIRECT: {figures['disk_ratio']:.2f} -> "
              f"{'met' if met['disk_ratio_ge_0.8'] else 'NOT met'}")
    return {"targets_met": met}
