"""``--gpu-memory-utilization`` on the device: the KV pool sized from free memory after the
profile step (``workers.memory_profile``), checked against what the GPU then holds.

On CUDA, with the parity checkpoint in fp32 and a fraction chosen to leave the engine about
``HEADROOM_GIB`` above what the process already uses (so the pool is sized by memory, not by its
cap): the engine starts; its pool fits in that headroom and fills at least half of it (the small
model's weights and step take little); after generating (the decode graphs captured), the GPU's
used memory stays within the fraction plus ``GRAPH_SLACK_GIB``; greedy ids equal
``transformers``; a fraction below what is already used is refused with the figures. On CPU
(``--quick``) the engine must refuse the option by name.
"""

from __future__ import annotations

import torch

from scripts.gpu.common import CheckContext, Report, free_device_memory
from scripts.gpu.models import hf_greedy, load_hf
from scripts.gpu.parity import parity_prompts
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams

GIB = 1 << 30
HEADROOM_GIB = 1.0
GRAPH_SLACK_GIB = 0.5  # CUDA graphs are captured after sizing, in memory the fraction leaves


def sized_config(ctx: CheckContext, utilization: float) -> EngineConfig:
    return EngineConfig(model=str(ctx.parity_model()), device=ctx.device.type, dtype="float32",
                        block_size=16, max_num_batched_tokens=256, max_num_seqs=256,
                        gpu_memory_utilization=utilization, seed=0)


def check_memory_sizing(ctx: CheckContext, report: Report) -> None:
    if not ctx.is_cuda:
        try:
            LLM(sized_config(ctx, 0.5)).shutdown()
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        report.check("refused on CPU by name", "--gpu-memory-utilization" in refused
                     and "CPU" in refused, refused[:160])
        return
    free, total = torch.cuda.mem_get_info(ctx.device)
    used_before = total - free
    utilization = (used_before + HEADROOM_GIB * GIB) / total
    report.figure("device_total_gib", total / GIB)
    report.figure("used_before_gib", used_before / GIB)
    report.figure("utilization", utilization)
    prompts, max_new = parity_prompts(ctx)
    hf = load_hf(ctx.parity_model(), ctx.device, torch.float32)
    reference = hf_greedy(hf, prompts, max_new)
    del hf
    free_device_memory()
    with LLM(sized_config(ctx, utilization)) as llm:
        spec = llm.engine.rank.runner.kv_cache.spec
        pool_gib = spec.num_blocks * spec.bytes_per_block / GIB
        report.figure("kv_blocks", spec.num_blocks)
        report.figure("kv_pool_gib", pool_gib)
        report.check("the pool fits in the headroom and fills at least half of it",
                     HEADROOM_GIB / 2 <= pool_gib <= HEADROOM_GIB, f"{pool_gib:.3f} GiB")
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0))
        free, _ = torch.cuda.mem_get_info(ctx.device)
        used_gib = (total - free) / GIB
        report.figure("used_after_generate_gib", used_gib)
        report.check("GPU memory within the fraction (plus the graphs' slack)",
                     used_gib <= utilization * total / GIB + GRAPH_SLACK_GIB,
                     f"{used_gib:.2f} GiB of {utilization * total / GIB:.2f} allowed")
    report.check("greedy ids equal transformers", [o.output_token_ids for o in outs] == reference)
    free_device_memory()
    try:
        LLM(sized_config(ctx, used_before / total / 2)).shutdown()
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    report.check("a fraction below what is in use is refused with the figures",
                 "leaves no room for the KV cache" in refused, refused[:200])
