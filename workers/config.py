"""Engine configuration, validated on construction; errors say what to change."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from kv.tiers.write_policy import WRITE_POLICIES, check_write_policy
from workers.option_field import option


ATTENTION_BACKENDS = ("auto", "torch", "triton")
CPU_BINDINGS = ("auto", "none")
KV_EVICTIONS = ("lru", "hotness")
TIERS = "KV tiers (per rank)"  # the help section of the tier options


@dataclass(frozen=True)
class EngineConfig:
    """What an engine runs and how; each ``option`` field is also a CLI flag (cluster.options)."""

    model: str = option("default", "checkpoint directory, or 'default' (SmolLM2-135M-Instruct)")
    tp_size: int = option(1, "tensor-parallel size", flag="--tp")
    block_size: int = option(16, "tokens per KV block")
    # caps the device pool; None: from kv_cache_gb
    num_kv_blocks: Optional[int] = option(None, "cap on device KV blocks", flag="--kv-blocks")
    kv_cache_gb: float = option(
        2.0, "device KV pool per rank in GiB (when --kv-blocks is not set)")
    # CUDA: the pool takes what this fraction of each rank's GPU leaves once the weights are
    # loaded and the largest step has run (kv_cache_gb unused, num_kv_blocks a cap); None: off
    gpu_memory_utilization: Optional[float] = option(
        None, "CUDA: the fraction of each GPU the rank may use; the KV pool takes what it leaves "
              "after the weights and the largest step (instead of --kv-cache-gb; --kv-blocks "
              "caps it)")
    enable_prefix_cache: bool = option(True, "disable prefix caching", flag="--no-prefix-cache")
    max_num_batched_tokens: int = option(2048, "token budget of one step (chunked prefill)")
    max_num_seqs: int = option(128, "requests per step")
    # None: the model's max_position_embeddings
    max_model_len: Optional[int] = option(None, "context length cap")
    # auto: workers.rank.resolve_dtype
    dtype: str = option("auto", "auto, float32, bfloat16 or float16; auto: bfloat16 on a CPU with "
                                "AMX or AVX-512 BF16, else float32; on CUDA the checkpoint's")
    device: str = option("auto", "auto, cpu or cuda")  # auto: CUDA when available, else CPU
    seed: int = 0  # for requests without a seed of their own
    attention_backend: str = option(
        "auto", "attention kernels: torch (PyTorch reference) or triton (paged kernels; on CPU "
                "only under TRITON_INTERPRET=1); auto: triton on CUDA, torch on CPU",
        choices=ATTENTION_BACKENDS)
    # How long a collective of a TP group may wait (a hung rank fails the step after this; the
    # serving engine's watchdog also fails a step running past it, or past 10x recent steps).
    step_timeout_s: float = option(
        30.0, "how long a collective of a TP group may wait, and the floor of the deadline "
              "after which a serving group with a hung rank is declared failed (default 30)")
    # True: no CUDA graphs. False: decode steps replay CUDA graphs where they can (CUDA with the
    # triton backend; elsewhere every step runs eager, said once in the log).
    enforce_eager: bool = option(
        False, "no CUDA graphs: every decode step launches its kernels (by default decode steps "
               "replay CUDA graphs on CUDA with the triton backend)")
    # The overlapped step loop (workers.engine): None decides by device (on for CUDA, where the
    # host's work hides behind the GPU's; off on CPU, where both share the cores).
    async_scheduling: Optional[bool] = option(
        None, "overlap the host's work of each step (sampled ids, stop checks, detokenizing, "
              "scheduling the next step) with the device computing the next one (default: on "
              "for CUDA, off on CPU)")
    # CPU ranks on cores of their own (parallel.cpu_binding): the ranks of served groups and of
    # tpserve generate; LLM() in a caller's process only when it passes bind_cpu_cores.
    cpu_binding: str = option(
        "auto", "CPU ranks: auto runs each rank's process (served groups, tpserve generate) on "
                "cores of its own, one per torch thread, where its node keeps a core for the "
                "rest, and tpserve serve's local Ray on the cores left; none leaves both to the OS",
        choices=CPU_BINDINGS)
    # The nice value of those ranks' processes (parallel.cpu_binding.set_process_nice).
    cpu_rank_nice: int = option(
        -10, "CPU ranks on cores of their own (--cpu-binding auto): the nice value their "
             "processes ask for, above the host's other processes on those cores (needs "
             "CAP_SYS_NICE; where refused, the log says so and the rank keeps its priority); 0 "
             "leaves it")
    # KV tiers below the device pool (per rank): host memory, then local disk.
    # 0 and host_kv_blocks None: no host tier; host_kv_blocks wins over host_kv_gb
    host_kv_gb: float = option(0.0, "host-memory KV tier in GiB (0: none)", group=TIERS)
    host_kv_blocks: Optional[int] = option(
        None, "host-memory KV tier in blocks (instead of --host-kv-gb)", group=TIERS)
    # A directory, or a comma-separated list that blocks are striped over; needs a host tier.
    disk_kv_dir: Optional[str] = option(
        None, "directory of the disk KV tier, or a comma-separated list (one per drive) that its "
              "blocks are striped over", group=TIERS)
    disk_kv_gb: float = option(0.0, "disk KV tier in GiB (all directories together)",
                               group=TIERS)
    disk_kv_blocks: Optional[int] = option(
        None, "disk KV tier in blocks (instead of --disk-kv-gb)", group=TIERS)
    kv_eviction: str = option("lru", "eviction policy of every tier", choices=KV_EVICTIONS,
                              group=TIERS)
    kv_hotness_decay: float = option(  # EMA decay per request
        0.95, "hotness: decay of the per-request moving average of accesses", group=TIERS)
    kv_pin_threshold: float = option(
        0.9, "hotness: blocks above this are held on the device (evicted only as a last "
             "resort; a copy is kept on host)", group=TIERS)
    kv_snapshot_interval_s: float = 300.0  # how often the disk tier's index is saved
    # When blocks go down a tier (kv/tiers/write_policy.py).
    kv_write_policy: str = option(
        "write_through", "when a block goes down a tier: write_through (when released), "
                         "write_through_selective (when released, once hit --kv-write-threshold "
                         "times), write_back (when evicted above)",
        choices=WRITE_POLICIES, group=TIERS)
    kv_write_threshold: int = option(
        1, "write_through_selective: prefix hits a block needs to go down", group=TIERS)
    kv_spill_gbps: Optional[float] = option(
        None, "bound on write-through spill bandwidth per rank in GB/s (default: none); spills "
              "queue behind it and are dropped if evicted first", group=TIERS)
    # A served request's grammar (structured output) compiles off the engine thread within this.
    grammar_compile_timeout_s: float = option(
        10.0, "how long a structured-output grammar (JSON schema, regex, EBNF) may take to "
              "compile before its request is refused (default 10)")
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
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("--grammar-compile-timeout-s must be positive, "
                             f"got {self.grammar_compile_timeout_s}")
        if self.cpu_binding not in CPU_BINDINGS:
            raise ValueError(f"--cpu-binding must be auto or none, got {self.cpu_binding!r}")
        if not -20 <= self.cpu_rank_nice <= 19:
            raise ValueError(f"--cpu-rank-nice must be from -20 to 19, got {self.cpu_rank_nice}")
        if self.attention_backend not in ATTENTION_BACKENDS:
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
        if self.kv_eviction not in KV_EVICTIONS:
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
