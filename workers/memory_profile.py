"""``--gpu-memory-utilization``: the KV pool sized from what a CUDA device has left once the
rank holds its weights and has run its largest step, as vLLM and SGLang size theirs.

    used      = total - free, measured after the profile step (this rank's weights, the CUDA
                context, NCCL's buffers, other processes on the GPU)
    budget    = utilization * total - used - peak step memory - sampler reserve
    num_blocks = budget // bytes per block - 1 (the scratch block), the same on every rank of a
                 group (the smallest)

The profile step is the largest the scheduler may send: ``max_num_batched_tokens`` tokens, one
long prefill plus a decoding row for each other sequence up to ``max_num_seqs``, every sequence
sampled, through the real model into a KV cache just big enough for it. Its peak is read from
PyTorch's allocator; the sampler, which runs on rank 0 after the step, is reserved for from the
logits' size (probabilities, a sorted copy and its indices per sampled row). CUDA graphs are
captured later, with their static outputs (``max_num_seqs`` x vocabulary logits in the model's
dtype on rank 0, logged when allocated), and the KV tiers' copy staging buffer
(`kv.tiers.block_staging`, at most ``DEFAULT_STAGING_BYTES``) is allocated later, all in the
memory the utilization leaves free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from kv.kv_cache import KVCache, KVCacheSpec
from workers.model_runner import ModelRunner
from workers.step_plan import NewSeqStep, StepPlan

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Bytes per sampled row and vocabulary entry the sampler may hold at once: fp32 probabilities,
# an fp32 sorted copy (top-p / top-k) and its int64 indices.
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 8


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's device memory, in bytes, as the sizing reads it."""

    total: int
    used: int  # not free, after the profile step
    peak_step: int  # the profile step's peak above what was allocated before it
    sampler_reserve: int

    def num_blocks(self, utilization: float, bytes_per_block: int) -> int:
        """The pool's blocks ``utilization`` of the device leaves room for (0 or less: none),
        one block kept for the scratch block a pool may have after them (`KVCache`)."""
        budget = int(utilization * self.total) - self.used - self.peak_step - self.sampler_reserve
        return budget // bytes_per_block - 1

    def no_room(self, utilization: float) -> str:
        """Why ``utilization`` leaves no room for a block, with the figures."""
        return (f"--gpu-memory-utilization {utilization:g} leaves no room for the KV cache: of "
                f"the device's {self.total / GIB:.2f} GiB, {self.used / GIB:.2f} GiB are in use "
                f"(weights, CUDA context, other processes), the largest step needs "
                f"{self.peak_step / GIB:.2f} GiB and sampling {self.sampler_reserve / GIB:.2f} "
                f"GiB; raise --gpu-memory-utilization, lower --max-num-batched-tokens or "
                f"--max-num-seqs, or raise --tp")


def profile_plan(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> StepPlan:
    """The largest step the scheduler may send: one prefill of the tokens left over by a
    one-token row for each other sequence; every sequence sampled. Block ids from 0 up."""
    num_tokens = min(max_num_batched_tokens, max_model_len * max_num_seqs)
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    lengths = [min(max_model_len, num_tokens - (num_seqs - 1))] + [1] * (num_seqs - 1)
    seqs, next_block = [], 0
    for seq_id, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        seqs.append(NewSeqStep(seq_id, (0,) * length, 0,
                               tuple(range(next_block, next_block + num_blocks)), True))
        next_block += num_blocks
    return StepPlan(seqs=tuple(seqs))


def plan_blocks(plan: StepPlan) -> int:
    return sum(len(step.block_ids) for step in plan.seqs if isinstance(step, NewSeqStep))


def run_profile_step(model, spec: KVCacheSpec, device: torch.device, plan: StepPlan,
                     max_model_len: int) -> Optional[torch.Tensor]:
    """Run ``plan`` through ``model`` into a KV cache of its own (``spec`` with the plan's
    blocks), dropped afterwards with its runner; returns the logits (rank 0; None elsewhere)."""
    cache_spec = KVCacheSpec(spec.num_layers, plan_blocks(plan), spec.block_size,
                             spec.num_kv_heads, spec.head_dim, spec.dtype)
    cache = KVCache(cache_spec, device, with_scratch_block=model.attention.reads_block_tables)
    runner = ModelRunner(model, cache, device, max_model_len, cuda_graphs=False,
                         max_graph_batch=len(plan.seqs))
    step = runner.execute(plan)
    return None if step is None else step.logits


def profile_memory(model, spec: KVCacheSpec, device: torch.device, plan: StepPlan,
                   max_model_len: int) -> MemoryProfile:
    """Run the profile step on CUDA and read the device's memory around it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logits = run_profile_step(model, spec, device, plan, max_model_len)
    torch.cuda.synchronize(device)
    cache_bytes = plan_blocks(plan) * spec.bytes_per_block
    peak_step = max(0, torch.cuda.max_memory_allocated(device) - before - cache_bytes)
    reserve = sampler_reserve(logits)
    del logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total, total - free, peak_step, reserve)


def sampler_reserve(logits: Optional[torch.Tensor]) -> int:
    """Bytes the sampler may hold for the profile step's ``logits`` ``[rows, vocab]``: 0 on the
    ranks that get none (TP ranks 1..N-1, which do not sample)."""
    if logits is None:
        return 0
    num_rows, vocab = logits.shape
    return num_rows * vocab * SAMPLER_BYTES_PER_LOGIT


def agree_min(value: int, cpu_group: Optional[dist.ProcessGroup]) -> int:
    """The smallest ``value`` of the group's ranks (``value`` itself without a group)."""
    if cpu_group is None:
        return value
    agreed = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=cpu_group)
    return int(agreed.item())


def size_kv_pool(model, spec: KVCacheSpec, device: torch.device, utilization: float,
                 max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 cpu_group: Optional[dist.ProcessGroup] = None) -> int:
    """The group's KV blocks per rank for ``utilization`` of each rank's CUDA device: the
    smallest any rank fits, at most ``spec.num_blocks`` (the engine's cap). Every rank of the
    group calls it at once (the profile step's all-reduces and the agreement are collectives);
    all of them raise ``ValueError`` when a rank has no room for a block."""
    plan = profile_plan(max_num_batched_tokens, max_num_seqs, max_model_len, spec.block_size)
    profile = profile_memory(model, spec, device, plan, max_model_len)
    fits = min(spec.num_blocks, profile.num_blocks(utilization, spec.bytes_per_block))
    logger.info("--gpu-memory-utilization %g of %.2f GiB: %.2f GiB in use, the largest step "
                "(%d tokens, %d sequences) %.2f GiB, sampling %.2f GiB: %d KV blocks of %.1f "
                "MiB fit on this rank (cap %d)", utilization, profile.total / GIB,
                profile.used / GIB, plan.num_tokens, len(plan.seqs), profile.peak_step / GIB,
                profile.sampler_reserve / GIB, fits, spec.bytes_per_block / 2**20,
                spec.num_blocks)
    agreed = agree_min(fits, cpu_group)
    if fits < 1:
        raise ValueError(profile.no_room(utilization))
    if agreed < 1:
        raise ValueError(f"--gpu-memory-utilization {utilization:g} leaves no room for the KV "
                         f"cache on another rank of the group (its log has the figures)")
    return agreed

