"""Building the KV tiers: each rank's storage and transfer engine, and rank 0's bookkeeping.

An engine claims the first ``<disk_kv_dir>/engine<i>/`` no other engine holds (so several groups
on one host can share a directory, and a restarted one finds its blocks again); each of its ranks
owns ``engine<i>/rank<r>/``: ``blocks.bin`` (its shard of every disk block),
``checksums.snapshot`` (slot -> tag, checksum) and, on rank 0, ``tokens.snapshot`` (slot -> block
hash and tokens, what a prefix lookup needs). A snapshot carries the identity of the model and KV
layout that wrote it; one from another model, another TP size or a truncated one is ignored with a
warning. On a warm start the ranks agree (all-reduce MIN and MAX of every slot's tag) on the slots
that every rank holds for the same block; rank 0 adopts those whose tokens it knows. The bytes
themselves are checked again, by checksum, whenever they come back.

With several directories (``--disk-kv-dir a,b,c``) the engine claims the same ``engine<i>`` in
every one (the first ``i`` free in all), each rank stripes its blocks over one ``blocks.bin`` per
directory (``kv.tiers.disk.striped``), and the snapshots live in the first directory only. The stripe
layout (unit size, every file's path, in order) is part of the checksum snapshot's identity, so
a list of another count or order starts cold with a warning instead of misreading blocks; a
snapshot left in a directory that is no longer first is removed, since its blocks will be
overwritten.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from kv.tiers.disk.index import DirectoryLock, lock_directory, read_snapshot, warn_unknown_files, \
    write_snapshot
from kv.eviction import HotnessTracker, make_policy
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache
from kv.kv_manager import KVCacheManager
from kv.prefix_hash import BlockHash
from kv.tiers.disk.striped import StripedDiskStore
from kv.tiers.index import TierEntry, TierIndex
from kv.tiers.hierarchy import KVTiers
from kv.tiers.transfer import TransferEngine
from workers.config import EngineConfig, parse_disk_kv_dirs
from workers.loader import checkpoint_files

logger = logging.getLogger(__name__)

BLOCKS_FILE = "blocks.bin"
CHECKSUMS_FILE = "checksums.snapshot"
TOKENS_FILE = "tokens.snapshot"
_KNOWN_FILES = (BLOCKS_FILE, CHECKSUMS_FILE, TOKENS_FILE)
_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class RankTierConfig:
    """What one rank needs to build its tiers (picklable: it travels to the rank's process)."""

    num_host_blocks: int
    # This engine's directory (``engine<i>``) under the first --disk-kv-dir: snapshots go there.
    disk_dir: Optional[str]
    num_disk_blocks: int  # all directories together
    identity: str  # the model and KV layout the disk blocks belong to
    extra_disk_dirs: Tuple[str, ...] = ()  # ``engine<i>`` under the other --disk-kv-dir entries
    block_bytes: int = 0  # one block's KV bytes on one rank (what --kv-spill-gbps counts)

    @property
    def disk_dirs(self) -> Tuple[str, ...]:
        """Every ``engine<i>`` directory the disk blocks are striped over, in order."""
        return () if self.disk_dir is None else (self.disk_dir, *self.extra_disk_dirs)


@dataclass
class RankTiers:
    """One rank's tier storage and the engine that moves its blocks."""

    transfer: TransferEngine
    host: HostBuffer
    disk: Optional[StripedDiskStore]
    lock: Optional[DirectoryLocks]
    recovered_disk_tags: Dict[int, int]  # slot -> block hash every rank holds (warm start)

    def close(self) -> None:
        """Finish queued transfers, then release memory, files and locks."""
        self.transfer.close()
        self.host.close()
        if self.disk is not None:
            self.disk.close()
        if self.lock is not None:
            self.lock.release()


class DirectoryLocks:
    """Locks held together (one per directory of a striped disk tier), released together."""

    def __init__(self, locks: Sequence[DirectoryLock]) -> None:
        self.locks = list(locks)

    def release(self) -> None:
        """Release every lock; idempotent."""
        for lock in self.locks:
            lock.release()


def model_identity(model_dir: Path, dtype: str, block_size: int, tp_size: int) -> str:
    """A digest of the checkpoint (config, shard names and sizes, first and last MiB of each shard)
    and the KV layout: blocks written under another identity are not this model's KV."""
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    digest.update(f"dtype={dtype},block_size={block_size},tp={tp_size}".encode())
    return digest.hexdigest()[:32]


def tier_sizes(config: EngineConfig, bytes_per_block: int) -> Tuple[int, int]:
    """(host blocks, disk blocks) per rank from the config's block counts or GiB."""
    slot_bytes = -(-bytes_per_block // 4096) * 4096
    host = config.host_kv_blocks
    if host is None:
        host = int(config.host_kv_gb * (1 << 30)) // slot_bytes
    disk = 0
    if config.disk_kv_dir is not None:
        disk = config.disk_kv_blocks
        if disk is None:
            disk = int(config.disk_kv_gb * (1 << 30)) // slot_bytes
    if config.has_host_tier and host < 1:
        raise ValueError(f"--host-kv-gb {config.host_kv_gb} holds no block of {slot_bytes} bytes")
    if config.disk_kv_dir is not None and disk < 1:
        raise ValueError(f"--disk-kv-gb {config.disk_kv_gb} holds no block of {slot_bytes} bytes")
    num_dirs = len(config.disk_kv_dirs)
    if disk < num_dirs:
        raise ValueError(f"the disk tier holds {disk} blocks of {slot_bytes} bytes, fewer than "
                         f"the {num_dirs} directories of --disk-kv-dir: raise --disk-kv-gb or "
                         f"--disk-kv-blocks (the total over all directories)")
    return host, disk


_MAX_ENGINES_PER_DIR = 64


def claim_engine_dir(disk_kv_dirs: Union[str, Sequence[str]]
                     ) -> Tuple[List[Path], DirectoryLocks]:
    """The first ``engine<i>`` that no running engine holds in any of ``disk_kv_dirs`` (a list,
    or ``--disk-kv-dir``'s comma-separated string): that directory under each of them (same
    ``i``, so a restart with the same list finds all its files again) and the locks on them.
    ``ValueError`` naming a directory that cannot be created or written."""
    if isinstance(disk_kv_dirs, str):
        disk_kv_dirs = parse_disk_kv_dirs(disk_kv_dirs)
    for directory in disk_kv_dirs:
        _check_writable(Path(directory))
    for index in range(_MAX_ENGINES_PER_DIR):
        paths = [Path(directory) / f"engine{index}" for directory in disk_kv_dirs]
        locks = DirectoryLocks([])
        try:
            for path in paths:
                locks.locks.append(_lock(path))
        except RuntimeError:  # another engine holds engine<index> in one of them
            locks.release()
            continue
        except BaseException:
            locks.release()
            raise
        return paths, locks
    raise RuntimeError(f"--disk-kv-dir {','.join(disk_kv_dirs)}: {_MAX_ENGINES_PER_DIR} engines "
                       "already use it; give this one another directory")


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".tmp.probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--disk-kv-dir entry {str(directory)!r} cannot be created or written "
                         f"({exc.strerror or exc}); give a writable directory") from None


def _lock(directory: Path) -> DirectoryLock:
    try:
        return lock_directory(directory)
    except OSError as exc:
        raise ValueError(f"--disk-kv-dir directory {str(directory)!r} cannot be created or "
                         f"written ({exc.strerror or exc})") from None


def rank_dir(engine_dir: str, rank: int) -> Path:
    return Path(engine_dir) / f"rank{rank}"


def build_rank_tiers(config: RankTierConfig, kv_cache: KVCache, rank: int,
                     cpu_group: Optional[dist.ProcessGroup],
                     wait_timeout_s: float = 600.0) -> RankTiers:
    """This rank's host buffer, disk file and transfer engine; agrees on recovered disk blocks.

    A wait for this rank's transfers raises if not done within ``wait_timeout_s``."""
    device = kv_cache.data.device
    host = HostBuffer(config.num_host_blocks, kv_cache.spec.bytes_per_block,
                      pin=device.type == "cuda")
    disk, lock, index_path = None, None, None
    identity = f"{config.identity}/rank{rank}"
    if config.disk_dir is not None:
        disk, lock = _open_disk(config, rank, host.slot_bytes)
        index_path = rank_dir(config.disk_dir, rank) / CHECKSUMS_FILE
        identity += disk.layout_identity
    transfer = TransferEngine(kv_cache, host, disk, index_path, identity, wait_timeout_s)
    recovered: Dict[int, int] = {}
    if disk is not None:
        recovered = agree_disk_tags(transfer.disk_tags(), config.num_disk_blocks, cpu_group)
    return RankTiers(transfer, host, disk, lock, recovered)


def _open_disk(config: RankTierConfig, rank: int,
               slot_bytes: int) -> Tuple[StripedDiskStore, DirectoryLocks]:
    """Lock this rank's directory under every ``engine<i>`` and open its striped store."""
    directories = [rank_dir(engine_dir, rank) for engine_dir in config.disk_dirs]
    locks = DirectoryLocks([])
    try:
        for position, directory in enumerate(directories):
            locks.locks.append(lock_directory(directory))
            if position > 0:
                _remove_stale_snapshots(directory)
            warn_unknown_files(directory, _KNOWN_FILES)
        disk = StripedDiskStore([d / BLOCKS_FILE for d in directories], config.num_disk_blocks,
                                slot_bytes)
    except BaseException:
        locks.release()
        raise
    return disk, locks


def _remove_stale_snapshots(directory: Path) -> None:
    """Snapshots in a directory that is not first in the list were written when it was (another
    list): this layout overwrites its blocks, so they would describe bytes that are gone."""
    for name in (CHECKSUMS_FILE, TOKENS_FILE):
        path = directory / name
        if path.exists():
            logger.warning("%s: written when %s came first in --disk-kv-dir; the list has "
                           "changed, so its blocks are not reused and the snapshot is removed",
                           path, directory.parent.parent)
            path.unlink()


def disk_bytes_by_dir(config: RankTierConfig,
                      disk: StripedDiskStore) -> Dict[str, Tuple[int, int]]:
    """``--disk-kv-dir`` entry -> (bytes written, bytes read) of this rank's file there."""
    return {str(Path(engine_dir).parent): counts
            for engine_dir, counts in zip(config.disk_dirs, disk.directory_bytes())}

def tier_stats(kv: KVCacheManager, rank_tiers: Optional[RankTiers],
               tier_config: Optional[RankTierConfig], tp_size: int,
               block_size: int) -> Dict[str, object]:
    """The tiers' numbers for the serving layer, keyed ``kv_tier_*`` (counters end in
    ``_total``; bytes count every rank's shard; latency samples are rank 0's, per batch of
    transfers, since the last call). Empty without tiers."""
    tiers = kv.tiers
    if tiers is None or rank_tiers is None or tier_config is None:
        return {}
    pool, transfer, ranks = kv.pool, rank_tiers.transfer, tp_size
    stats: Dict[str, object] = {
        "device_blocks_used": pool.num_used, "device_blocks_total": pool.num_blocks,
        "device_queries_total": kv.num_prefix_queries // block_size,
        "device_hits_total": kv.num_device_hits // block_size,
        **tiers.usage(),
        "spilled_bytes_total": transfer.num_bytes_spilled * ranks,
        "restored_bytes_total": transfer.num_bytes_restored * ranks,
        "disk_written_bytes_total": transfer.num_bytes_disk_written * ranks,
        "disk_read_bytes_total": transfer.num_bytes_disk_read * ranks,
        "transfer_latency_seconds": transfer.transfer_latency.drain(),
    }
    if rank_tiers.disk is not None:  # by --disk-kv-dir entry: {dir: bytes}
        by_dir = disk_bytes_by_dir(tier_config, rank_tiers.disk)
        stats["disk_dir_written_bytes_total"] = {d: w * ranks for d, (w, _) in by_dir.items()}
        stats["disk_dir_read_bytes_total"] = {d: r * ranks for d, (_, r) in by_dir.items()}
    return {f"kv_tier_{key}": value for key, value in stats.items()}


def agree_disk_tags(local: Dict[int, int], num_slots: int,
                    cpu_group: Optional[dist.ProcessGroup]) -> Dict[int, int]:
    """Slots that every rank holds with the same tag (a collective over ``cpu_group``)."""
    if cpu_group is None:
        return dict(local)
    present = torch.zeros(num_slots, dtype=torch.int64)
    tags = torch.zeros(num_slots, dtype=torch.int64)
    for slot, tag in local.items():
        present[slot] = 1
        tags[slot] = _signed64(tag)
    low, high = tags.clone(), tags.clone()
    dist.all_reduce(present, op=dist.ReduceOp.MIN, group=cpu_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=cpu_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=cpu_group)
    agreed = (present == 1) & (low == high)
    return {slot: local[slot] for slot in agreed.nonzero().flatten().tolist()}


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def build_kv_manager(config: EngineConfig, num_blocks: int,
                     rank_config: Optional[RankTierConfig],
                     recovered_disk_tags: Dict[int, int]) -> KVCacheManager:
    """Rank 0's block manager, with host and disk tier bookkeeping when configured."""
    tracker = HotnessTracker(config.kv_hotness_decay) if config.kv_eviction == "hotness" else None

    def policy(hold_threshold: Optional[float]):
        return make_policy(config.kv_eviction, tracker, hold_threshold)

    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_cache,
                        policy(config.kv_pin_threshold), tracker)
    if rank_config is None:
        return kv
    host = TierIndex("host", rank_config.num_host_blocks, policy(None))
    disk = None
    if rank_config.disk_dir is not None:
        disk = TierIndex("disk", rank_config.num_disk_blocks, policy(None))
        disk.restore_entries(_recovered_entries(rank_config.disk_dir, rank_config.identity,
                                                recovered_disk_tags))
        if disk.entries:
            logger.info("disk KV tier: %d blocks recovered from %s", len(disk.entries),
                        rank_config.disk_dir)
    kv.tiers = KVTiers(kv.pool, config.block_size, host, disk, config.kv_write_policy,
                       config.kv_write_threshold, config.kv_spill_gbps,
                       block_bytes=max(1, rank_config.block_bytes))
    return kv


def _recovered_entries(engine_dir: str, identity: str,
                       tags: Dict[int, int]) -> Dict[BlockHash, TierEntry]:
    path = rank_dir(engine_dir, 0) / TOKENS_FILE
    records = read_snapshot(path, "disk-tokens", identity) or []
    entries: Dict[BlockHash, TierEntry] = {}
    slots = set()
    for record in records:
        if not _is_token_record(record):
            logger.warning("%s: record %.80r is not [slot, block hash, [token ids]]; the snapshot "
                           "is ignored", path, record)
            return {}
        slot, block_hash, token_ids = record
        if tags.get(slot) == block_hash and block_hash not in entries and slot not in slots:
            entries[BlockHash(block_hash)] = TierEntry(slot, tuple(token_ids))
            slots.add(slot)
    return entries


def _is_token_record(record: object) -> bool:
    return (isinstance(record, list) and len(record) == 3
            and all(isinstance(v, int) for v in record[:2]) and isinstance(record[2], list)
            and all(isinstance(t, int) for t in record[2]))


def save_token_index(engine_dir: str, identity: str, tiers: KVTiers) -> None:
    """Rank 0's half of a disk snapshot: which block (hash and tokens) each disk slot holds."""
    assert tiers.disk is not None
    records = [[entry.slot, block_hash, list(entry.token_ids)]
               for block_hash, entry in tiers.disk.entries.items()]
    write_snapshot(rank_dir(engine_dir, 0) / TOKENS_FILE, "disk-tokens", identity, records)
