"""One tensor-parallel rank: join the group, load this rank's shard, allocate its KV pool, and
(on ranks 1..N-1) run the plans rank 0 broadcasts until told to stop.

Nothing here knows how the rank was launched: the engine's processes and, later, Ray actors call
the same ``build_rank`` and ``serve_plans``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from kv.attention.backend import make_attention_backend
from kv.huge_pages import back_with_huge_pages
from kv.kv_cache import KVCache, KVCacheSpec
from kv.tiers.ops import TierOpResults
from kv.tiers.transfer_progress import TransferError
from parallel.cpu_capability import cpu_bf16_support
from parallel.onednn_linear import pack_linear_weights, packed_weights, warm_up_linears
from parallel.cpu_binding import bind_rank_cores
from parallel.tp_group import TPGroup, TPGroupConfig, init_tp_group
from workers.cpu_malloc import keep_freed_memory
from workers.models.bf16_linear import pack_cpu_weight
from workers.device_memory import DeviceMemory, device_memory
from workers.loader import load_weights
from workers.memory_profile import size_kv_pool
from workers.model_config import ModelConfig, load_model_config
from workers.model_runner import ModelRunner
from workers.models.registry import model_class
from workers.step_logits import StepLogits
from workers.step_plan import StepPlan, broadcast_plan
from workers.tier_setup import RankTierConfig, RankTiers, build_rank_tiers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankConfig:
    """Everything a rank needs to build itself; picklable, so it can be sent to a process."""

    model_dir: str
    group: TPGroupConfig
    device: str  # "cpu" or "cuda:<index>"
    dtype: str  # a torch dtype name, e.g. "float32"
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    num_threads: Optional[int] = None  # CPU threads for this rank's torch ops
    tiers: Optional[RankTierConfig] = None  # host/disk KV tiers
    attention_backend: str = "torch"  # torch or triton, resolved by the engine
    cuda_graphs: bool = False  # decode steps through CUDA graphs (CUDA, triton backend)
    max_num_seqs: int = 256  # the largest decode batch a graph is captured for
    # CUDA: size the pool from this fraction of the device (num_kv_blocks is then the cap)
    gpu_memory_utilization: Optional[float] = None
    max_num_batched_tokens: int = 2048  # the largest step, profiled for the fraction above
    bind_cores: bool = False  # CPU: this process on cores of its own (parallel.cpu_binding)
    nice: int = 0  # with bind_cores: the nice value this process asks for there (0: as it is)


@dataclass
class Rank:
    tp: TPGroup
    config: ModelConfig
    runner: ModelRunner
    tiers: Optional[RankTiers] = None

    def close(self) -> None:
        """Finish queued transfers, release the tiers' memory and files."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None


@dataclass(frozen=True)
class RankReport:
    """What a rank tells the serving layer about itself: its failed collectives by kind
    (`parallel.collective_errors`) and its GPU's memory (None on CPU)."""

    rank: int
    collective_errors: Dict[str, int]
    memory: Optional[DeviceMemory] = None


def rank_report(rank: Rank) -> RankReport:
    """This rank's report now (one driver call on CUDA; callable from any thread)."""
    return RankReport(rank.tp.rank, rank.tp.collective_errors.counts(),
                      device_memory(rank.tp.device))


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str,
                  bf16_supported: Optional[bool] = None) -> torch.dtype:
    """``auto``: on CPU bfloat16 where the CPU has bf16 instructions (AMX or AVX-512 BF16,
    `parallel.cpu_capability`), else float32, whatever the checkpoint's dtype; on CUDA the
    checkpoint's dtype, but float16 for a bfloat16 checkpoint on a GPU without bfloat16 (before
    compute capability 8.0: T4, V100), as vLLM does. bfloat16 asked for is refused by name on
    such a GPU, and runs with a warning (slower than float32) on a CPU without bf16
    instructions. ``bf16_supported``: the device's answer (None: asked of the CPU or torch)."""
    auto = name == "auto"
    if device.type == "cpu":
        return _cpu_dtype(name, bf16_supported)
    dtype = _dtype_named(checkpoint_dtype if auto else name)
    if dtype is torch.bfloat16 and device.type == "cuda":
        if bf16_supported is None:
            try:
                bf16_supported = torch.cuda.is_bf16_supported(including_emulation=False)
            except TypeError:  # torch before the argument
                bf16_supported = torch.cuda.is_bf16_supported()
        if not bf16_supported:
            if not auto:
                raise ValueError("dtype bfloat16: this GPU has no bfloat16 (compute capability "
                                 "8.0 or later needed); use float16 or auto")
            logger.warning("the checkpoint is bfloat16 and this GPU has none: running float16")
            return torch.float16
    return dtype


def _dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a torch floating dtype "
                         f"(float32, bfloat16, float16 or auto)")
    return dtype


def _cpu_dtype(name: str, bf16_supported: Optional[bool]) -> torch.dtype:
    """The CPU's dtype for ``--dtype name``; ``bf16_supported`` None: probed (and logged) once."""
    if bf16_supported is None:
        support = cpu_bf16_support()
        bf16_supported, where = support.is_fast, support.path
    else:
        where = "as the caller says"
    dtype = (torch.bfloat16 if bf16_supported else torch.float32) if name == "auto" \
        else _dtype_named(name)
    if dtype is torch.bfloat16 and not bf16_supported:
        logger.warning("dtype bfloat16: this CPU has no bf16 instructions (AMX or AVX-512 BF16), "
                       "so bf16 is converted to fp32 on every op and runs slower than float32 "
                       "(--dtype auto picks float32 here)")
    elif dtype is torch.bfloat16:
        logger.info("dtype bfloat16 on CPU (%s; bf16 instructions: %s): linears on oneDNN's bf16 "
                    "kernels, prefills on tpserve's bf16 kernel where it loads (else torch's flash "
                    "kernel), decodes on the C kernel where it loads",
                    "auto" if name == "auto" else "asked", where)
    return dtype


def build_rank(config: RankConfig, check_peers: Optional[Callable[[], None]] = None) -> Rank:
    """This rank, built; rank 0 calls ``check_peers`` (the launcher's ``check``) while it waits
    for the others to join."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if device.type == "cpu":
        keep_freed_memory()  # no page faults on each step's large temporaries
        if config.bind_cores:  # before the weights load: their pages go to its cores' node
            bind_rank_cores(config.num_threads or torch.get_num_threads(), nice=config.nice)
    tp = init_tp_group(config.group, device, check_peers)
    model_config = load_model_config(Path(config.model_dir))
    dtype = getattr(torch, config.dtype)
    attention = make_attention_backend(config.attention_backend)
    model = model_class(model_config.architecture)(model_config, tp, dtype, config.max_model_len,
                                                   attention)
    load_weights(model, Path(config.model_dir))
    num_packed = pack_linear_weights(model, pack_cpu_weight)  # CPU: packed copies of the shards
    num_kv_heads = model.model.layers[0].self_attn.qkv_proj.num_local_kv_heads
    spec = KVCacheSpec(model_config.num_layers, config.num_kv_blocks, config.block_size,
                       num_kv_heads, model_config.head_dim, dtype)
    if config.gpu_memory_utilization is not None:
        tp.wait_for_all_ranks()  # the profile step's all-reduces wait only a step's timeout
        spec = dataclasses.replace(spec, num_blocks=size_kv_pool(
            model, spec, device, config.gpu_memory_utilization, config.max_num_batched_tokens,
            config.max_num_seqs, config.max_model_len, tp.startup_group or tp.cpu_group))
    # Backends that read block tables may pad a batch (CUDA graphs): padded rows need a block.
    kv_cache = KVCache(spec, device, with_scratch_block=attention.reads_block_tables)
    if device.type == "cpu":
        weights_on_huge_pages(model)
        warm_up_cpu_linears(model, config.max_num_seqs, dtype)
    runner = ModelRunner(model, kv_cache, device, config.max_model_len, config.cuda_graphs,
                         config.max_num_seqs)
    if runner.graphs is not None:  # before the tiers' copy thread starts
        tp.wait_for_all_ranks()  # the captures' all-reduces wait only a step's timeout
        runner.capture_graphs()
    tiers = None
    if config.tiers is not None:
        # A transfer may keep a step waiting as long as a collective may, and no longer. The
        # ranks agree on the disk tier's blocks while starting: over the startup group.
        tiers = build_rank_tiers(config.tiers, kv_cache, tp.rank,
                                 tp.startup_group or tp.cpu_group,
                                 wait_timeout_s=config.group.timeout_s)
    tp.wait_for_all_ranks()  # from here on the ranks wait for each other a step's timeout
    logger.info("rank %d/%d ready on %s (pid %d, %d linears through oneDNN)", tp.rank,
                tp.world_size, device, os.getpid(), num_packed)
    return Rank(tp, model_config, runner, tiers)


# Under this much of packed weights (tiny test checkpoints) a rank builds its linears' kernels as
# steps meet their row counts.
WARM_UP_MIN_BYTES = 64 << 20


def warm_up_cpu_linears(model: torch.nn.Module, max_num_seqs: int, dtype: torch.dtype) -> None:
    """oneDNN's kernels for every decode batch size (up to ``max_num_seqs`` rows, bucketed) of
    each packed linear shape, built before the first step instead of during the first steps (the
    bf16 kernel's weights build nothing: one call each)."""
    packed = [weight.packed for weight in packed_weights(model)]
    if sum(t.numel() * t.element_size() for t in packed) < WARM_UP_MIN_BYTES:
        return
    start = time.perf_counter()
    calls = warm_up_linears(model, max_num_seqs, dtype)
    logger.info("packed linears: %d warm-up calls over their shapes and row counts in %.2f s",
                calls, time.perf_counter() - start)


def weights_on_huge_pages(model: torch.nn.Module) -> None:
    """The weights a CPU rank's steps read, moved onto huge pages (`kv.huge_pages`): each
    packed copy (oneDNN's or the bf16 kernel's), and the parameters of modules without one."""
    tensors = []
    for module in model.modules():
        packed = getattr(module, "packed", None)
        is_packed = packed is not None  # a `parallel.onednn_linear.Packed`
        if is_packed:
            tensors.append(packed.packed)
        tensors += [p for name, p in module.named_parameters(recurse=False)
                    if not (name == "weight" and is_packed)]
    moved = back_with_huge_pages(tensors)
    if moved:
        logger.info("weights on huge pages: %.0f MiB", moved / 2**20)


def execute_plan(rank: Rank, plan: StepPlan
                 ) -> Tuple[Optional[StepLogits], Optional[TierOpResults]]:
    """Run one plan on this rank: queue its transfers, wait for spills still reading blocks the
    model is about to write (when the plan says so), run the model, then agree with the other
    ranks on finished transfers.

    Every rank reaches the agreement at the same plans (outstanding counts follow the plans), so
    its collectives match. Returns the step's logits (rank 0; `workers.step_logits`) and the
    agreed transfer outcomes, if any."""
    transfer = rank.tiers.transfer if rank.tiers is not None else None
    if transfer is not None and plan.tier_ops:
        transfer.submit(plan.tier_ops)
    if transfer is not None and plan.wait_spill_reads:
        transfer.wait_device_reads()
    step = rank.runner.execute(plan)
    results = None
    if transfer is not None and transfer.num_outstanding:
        # A TransferError is this rank's copy worker failing, not the collective.
        with rank.tp.counting_errors(not_collective=(TransferError,)):
            results = transfer.agree(rank.tp.cpu_group, wait=plan.wait_transfers)
    return step, results


def share_sampled(rank: Rank, plan: StepPlan, sampled: Optional[torch.Tensor] = None) -> None:
    """The ids rank 0 sampled for ``plan`` (``sampled``, there) become every rank's
    ``last_sampled``, broadcast over the device group (``plan.share_sampled``)."""
    if sampled is None:
        count = sum(step.needs_logits for step in plan.seqs)
        sampled = torch.empty(count, dtype=torch.long, device=rank.runner.device)
    rank.runner.last_sampled = rank.tp.broadcast_from_first(sampled)


def serve_plans(rank: Rank) -> None:
    """Loop of ranks 1..N-1: receive a plan, run it, until a shutdown plan arrives. A failed
    collective is counted on this rank's group and ends the loop."""
    try:
        while True:
            with rank.tp.counting_errors():
                plan = broadcast_plan(None, rank.tp.cpu_group)
            if plan.shutdown:
                break
            execute_plan(rank, plan)
            if plan.share_sampled:
                share_sampled(rank, plan)
    finally:
        rank.close()
    logger.info("rank %d stopping", rank.tp.rank)
