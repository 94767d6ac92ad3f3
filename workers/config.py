"""Engine configuration, validated on construction; errors say what to change."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from kv.tiers.write_policy import check_write_policy


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a checkpoint directory, or "default"
    tp_size: int = 1
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # caps the device pool; None: from kv_cache_gb
    kv_cache_gb: float = 2.0  # device pool per rank, when num_kv_blocks is None
    # CUDA: the pool takes what this fraction of each rank's GPU leaves once the weights are
    # loaded and the largest step has run (kv_cache_gb unused, num_kv_blocks a cap); None: off
    gpu_memory_utilization: Optional[float] = None
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    max_num_seqs: int = 128
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    dtype: str = "auto"  # auto: fp32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"  # auto: CUDA when available, else CPU
    seed: int = 0  # for requests without a seed of their own
    attention_backend: str = "auto"  # torch, triton; auto: triton on CUDA, torch on CPU
    # True: no CUDA graphs. False: decode steps replay CUDA graphs where they can (CUDA with the
    # triton backend; elsewhere every step runs eager, said once in the log).
    enforce_eager: bool = False
    # KV tiers below the device pool (per rank): host memory, then local disk.
    host_kv_gb: float = 0.0  # host tier size; 0 and host_kv_blocks None: no host tier
    host_kv_blocks: Optional[int] = None  # host tier in blocks (wins over host_kv_gb)
    # Disk tier directory, or a comma-separated list that blocks are striped over (one per
    # drive); needs a host tier.
    disk_kv_dir: Optional[str] = None
    disk_kv_gb: float = 0.0  # disk tier size (all directories together)
    disk_kv_blocks: Optional[int] = None  # disk tier in blocks (wins over disk_kv_gb)
    kv_eviction: str = "lru"  # lru or hotness, at every tier
    kv_hotness_decay: float = 0.95  # EMA decay per request of the hotness policy
    kv_pin_threshold: float = 0.9  # hotness above which a block stays on the device
    kv_snapshot_interval_s: float = 300.0  # how often the disk tier's index is saved
    # When blocks go down a tier (kv/tiers/write_policy.py): write_through, write_through_selective
    # (blocks hit kv_write_threshold times) or write_back (on eviction from the tier above).
    kv_write_policy: str = "write_through"
    kv_write_threshold: int = 1
    kv_spill_gbps: Optional[float] = None  # bound on write-through spills per rank; None: none
    # How long a collective of a TP group may wait (a hung rank fails the step after this; the
    # serving engine's watchdog also fails a step running past it, or past 10x recent steps).
    step_timeout_s: float = 30.0
    # Keep a StepRecord per step (benchmarks): about 0.7 GB an hour in a busy server, so off.
    record_steps: bool = False

    @property
    def disk_kv_dirs(self) -> Tuple[str, ...]:
        """The directories of ``disk_kv_dir`` in order; empty without a disk tier."""
        return () if self.disk_kv_dir is None else parse_disk_kv_dirs(self.disk_kv_dir)

    @property
    def has_host_tier(self) -> bool:
        return self.host_kv_blocks is not None or self.host_kv_gb > 0

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--kv-blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"--step-timeout-s must be positive, got {self.step_timeout_s}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("--attention-backend must be auto, torch or triton, "
                             f"got {self.attention_backend!r}")
        self._check_tiers()

    def _check_tiers(self) -> None:
        for name in ("host_kv_blocks", "disk_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        for name in ("host_kv_gb", "disk_kv_gb"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, "
                                 f"got {getattr(self, name)}")
        if self.kv_eviction not in ("lru", "hotness"):
            raise ValueError(f"--kv-eviction must be lru or hotness, got {self.kv_eviction!r}")
        if not 0 < self.kv_hotness_decay < 1:
            raise ValueError(f"--kv-hotness-decay must be in (0, 1), got {self.kv_hotness_decay}")
        if not 0 < self.kv_pin_threshold <= 1:
            raise ValueError(f"--kv-pin-threshold must be in (0, 1], got {self.kv_pin_threshold}")
        check_write_policy(self.kv_write_policy, self.kv_write_threshold, self.kv_spill_gbps)
        if self.kv_snapshot_interval_s <= 0:
            raise ValueError("--kv-snapshot-interval-s must be positive, "
                             f"got {self.kv_snapshot_interval_s}")
        if self.has_host_tier and not self.enable_prefix_cache:
            raise ValueError("KV tiers hold prefix-cached blocks: drop --no-prefix-cache or the "
                             "--host-kv-* options")
        has_disk_size = self.disk_kv_blocks is not None or self.disk_kv_gb > 0
        if self.disk_kv_dir is not None:
            parse_disk_kv_dirs(self.disk_kv_dir)
            if not self.has_host_tier:
                raise ValueError("--disk-kv-dir needs a host tier (--host-kv-gb or "
                                 "--host-kv-blocks): disk blocks come back through host memory")
            if not has_disk_size:
                raise ValueError("--disk-kv-dir needs a size: --disk-kv-gb or --disk-kv-blocks")
        elif has_disk_size:
            raise ValueError("--disk-kv-gb/--disk-kv-blocks need --disk-kv-dir")


def parse_disk_kv_dirs(value: str) -> Tuple[str, ...]:
    """``--disk-kv-dir a,b,c`` as ``("a", "b", "c")``; ``ValueError`` naming an empty entry or
    two entries that are the same directory (after resolving ``..`` and symbolic links)."""
    entries = tuple(entry.strip() for entry in value.split(","))
    seen = {}
    for position, entry in enumerate(entries, start=1):
        if not entry:
            raise ValueError(f"--disk-kv-dir {value!r}: entry {position} is empty; expected "
                             "directories separated by single commas")
        resolved = os.path.realpath(entry)
        if resolved in seen:
            raise ValueError(f"--disk-kv-dir {value!r}: {entry!r} is the same directory as "
                             f"{seen[resolved]!r} ({resolved}); list each directory once")
        seen[resolved] = entry
    return entries
