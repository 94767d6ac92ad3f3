"""Throughput section of ``scripts/gpu_check.py``: tpserve against ``transformers`` ``generate`` on
the same device, and against the device's limit.

The model is a random Llama shaped like Llama-3.2-1B (1.24B parameters, tied embeddings) in bf16;
with ``--quick`` a tiny one in fp32 (CPU) or bf16 (CUDA). The requests are the first 64 of the
Azure LLM inference code trace (``TRACE_LENGTHS``, copied from
``AzureLLMInferenceTrace_code.csv``: 150k prompt and 1.5k output tokens, unscaled on a GPU),
random token ids, greedy, each request generating exactly its trace output length (tpserve with
``ignore_eos``, ``transformers`` with ``min_new_tokens``). Systems, one after the other, warmed up:

* tpserve, once per attention backend ``EngineConfig`` offers: every request submitted at once,
  stepped until all finish (``engine_systems.run_tpserve``);
* ``transformers`` static batching: ``engine_systems.run_hf_generate``, left-padded batches sorted
  by prompt length.

``roofline_frac`` is the time tpserve's exact steps would take at the device's limit over its wall
time, each step costed as ``engine_limits.ModelCost`` does (weight bytes per step over memory
bandwidth, or FLOPs over the matmul rate, whichever is longer); the limit on CUDA is the H200's
4.8 TB/s HBM and 989 TFLOP/s dense bf16, on CPU what this machine measures in the same run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from scripts.engine import limits as engine_limits
from scripts.engine import systems as engine_systems
from scripts.engine import workloads as engine_workloads
from scripts.gpu.common import CheckContext, Report, free_device_memory
from scripts.gpu.models import LLAMA_1B, TINY_TIED, OnDevice, build_checkpoint
from scripts.gpu.parity import Variant, attention_backends, default_backend
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams

# (ContextTokens, GeneratedTokens) of the first 64 requests of AzureLLMInferenceTrace_code.csv.
TRACE_LENGTHS: Tuple[Tuple[int, int], ...] = (
    (4808, 10), (3180, 8), (110, 27), (7433, 14), (34, 12), (374, 14), (6985, 9), (34, 23),
    (1145, 7), (201, 24), (137, 9), (7427, 8), (1555, 19), (3893, 19), (1827, 10), (394, 17),
    (675, 6), (7436, 9), (158, 26), (6587, 18), (763, 8), (1556, 18), (5108, 12), (159, 127),
    (458, 67), (2464, 30), (4009, 51), (1632, 9), (2567, 45), (730, 36), (5108, 10), (2569, 7),
    (1832, 7), (1630, 9), (6587, 13), (7436, 6), (1044, 16), (327, 124), (1630, 9), (3351, 9),
    (1562, 18), (3724, 9), (328, 43), (965, 8), (6586, 11), (2366, 7), (328, 40), (1513, 29),
    (328, 9), (2025, 9), (2169, 13), (74, 14), (771, 142), (76, 18), (75, 16), (527, 27),
    (2024, 97), (197, 7), (109, 12), (432, 10), (2025, 19), (6586, 9), (7435, 9), (2648, 15),
)

H200_HBM_GBPS = 4800.0
H200_BF16_GFLOPS = 989_000.0


@dataclass(frozen=True)
class ThroughputPlan:
    shape: Dict[str, object]
    dtype: torch.dtype
    num_requests: int
    prompt_scale: float
    output_scale: float
    max_output: Optional[int]
    max_model_len: int
    kv_cache_gb: float
    max_num_batched_tokens: int
    hf_batch_size: int


def plan_for(ctx: CheckContext) -> ThroughputPlan:
    """The run's sizes; ``--num-requests``, ``--prompt-scale``, ``--output-scale`` override."""
    a = ctx.args
    if ctx.quick:
        plan = ThroughputPlan(TINY_TIED, torch.bfloat16 if ctx.is_cuda else torch.float32, 8,
                              1 / 32, 1.0, 8, 256, 0.05, 256, 4)
    else:
        plan = ThroughputPlan(LLAMA_1B, torch.bfloat16, 64, 1.0, 1.0, None, 8192, 16.0, 8192, 16)
    return ThroughputPlan(**{**plan.__dict__, **{k: v for k, v in (
        ("num_requests", a.num_requests), ("prompt_scale", a.prompt_scale),
        ("output_scale", a.output_scale)) if v is not None}})


def build_workload(plan: ThroughputPlan, vocab_size: int, seed: int = 0) -> engine_workloads.Workload:
    if not 1 <= plan.num_requests <= len(TRACE_LENGTHS):
        raise ValueError(f"--num-requests must be in [1, {len(TRACE_LENGTHS)}] (the trace "
                         f"requests copied into this script), got {plan.num_requests}")
    lengths = [engine_workloads.clamp_lengths(round(p * plan.prompt_scale),
                                          round(o * plan.output_scale), plan.max_model_len,
                                          plan.max_output)
               for p, o in TRACE_LENGTHS[:plan.num_requests]]
    prompts = engine_workloads.random_prompts([p for p, _ in lengths], vocab_size,
                                          random.Random(seed))
    return engine_workloads.Workload("azure-code", prompts, [o for _, o in lengths])


def run_engine(ctx: CheckContext, plan: ThroughputPlan, model_dir: Path,
               workload: engine_workloads.Workload, rehearsal: engine_workloads.Workload,
               variant: Variant):
    """tpserve's run of ``workload`` after a warm-up and a run of ``rehearsal``: (result, step
    records, model config)."""
    config = EngineConfig(model=str(model_dir), device=ctx.device.type,
                          dtype=str(plan.dtype).replace("torch.", ""),
                          max_model_len=plan.max_model_len, kv_cache_gb=plan.kv_cache_gb,
                          max_num_batched_tokens=plan.max_num_batched_tokens, record_steps=True,
                          **variant.kwargs())
    warm = [list(range(3, 3 + n)) for n in (min(300, plan.max_model_len // 2), 20)]
    # ``rehearsal``: the same lengths with other token ids (no prefix-cache hit), so every step
    # shape of the timed run (batch sizes, chunks, split counts) is seen once before it, and
    # Triton's compiles, made at first use, fall outside it (the decode graphs are captured
    # while the engine starts).
    try:
        with LLM(config) as llm:
            llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            engine_systems.run_tpserve(llm, rehearsal)
            result, steps = engine_systems.run_tpserve(llm, workload)
            return result, steps, llm.engine.model_config
    finally:
        free_device_memory()


def machine_limits(ctx: CheckContext, model_config) -> Tuple[float, float, str]:
    """(memory GB/s, matmul GFLOP/s, where they come from)."""
    if ctx.is_cuda:
        return H200_HBM_GBPS, H200_BF16_GFLOPS, (
            f"H200 datasheet: 4.8 TB/s HBM, 989 TFLOP/s dense bf16 (this device: "
            f"{torch.cuda.get_device_name(ctx.device)})")
    read = engine_limits.measure_read_gbps(0.25)
    matmul = max(engine_limits.measure_matmul_gflops(model_config))
    return read, matmul, "measured here: 256 MiB sum, fp32 mm"


def report_run(report: Report, prefix: str, result, steps, workload, cost, limits,
               hf) -> None:
    read, matmul, _ = limits
    limit_s = sum(cost.step_limit_s(s, read, matmul) for s in steps)
    tps = result.num_output_tokens / result.wall_s
    report.check(f"{prefix}tpserve generated every request's tokens",
                 [len(o) for o in result.outputs] == workload.max_tokens)
    figures = [("tokens_per_s", tps, "output tok/s"),
               ("roofline_frac", limit_s / result.wall_s, ""),
               ("limit_tokens_per_s", result.num_output_tokens / limit_s, ""),
               ("wall_s", result.wall_s, "s"), ("num_steps", len(steps), "")]
    if hf is not None:  # None: transformers' run failed (reported), its ratios with it
        same = sum(a == b for a, b in zip(result.outputs, hf.outputs)) / len(hf.outputs)
        figures += [("ratio_vs_hf_generate", tps / (hf.num_output_tokens / hf.wall_s), ""),
                    ("same_ids_as_hf_frac", same, "")]
    for name, value, unit in figures:
        report.figure(prefix + name, value, unit)


def check_throughput(ctx: CheckContext, report: Report) -> None:
    plan = plan_for(ctx)
    model_dir = ctx.workdir / "throughput"
    hf_model = build_checkpoint(model_dir, plan.shape, ctx.device.type, plan.dtype)
    workload = build_workload(plan, int(plan.shape["vocab_size"]))
    report.figure("model", "Llama-3.2-1B shape, random" if plan.shape is LLAMA_1B else "tiny")
    report.figure("dtype", str(plan.dtype).replace("torch.", ""))
    for key, value in (("num_requests", len(workload.prompts)),
                       ("prompt_tokens", workload.num_prompt_tokens),
                       ("output_tokens", workload.num_output_tokens),
                       ("prompt_scale", plan.prompt_scale), ("hf_batch_size", plan.hf_batch_size)):
        report.figure(key, value)
    hf = _attempt(report, "transformers generate", _run_hf, hf_model, workload,
                  plan.hf_batch_size)
    del hf_model
    free_device_memory()
    if hf is not None:
        report.check("transformers generated every request's tokens",
                     [len(o) for o in hf.outputs] == workload.max_tokens)
        report.figure("hf_generate_tokens_per_s", hf.num_output_tokens / hf.wall_s,
                      "output tok/s")
    rehearsal = build_workload(plan, int(plan.shape["vocab_size"]), seed=1)
    backends = attention_backends()
    headline = default_backend(ctx.device)
    for backend in sorted(backends, key=lambda b: b != headline):  # the headline one first
        if backend == "triton" and not ctx.is_cuda:
            report.unavailable("triton", "not timed on CPU: Triton's interpreter is for tests")
            continue
        run = _attempt(report, f"tpserve ({backend})", run_engine, ctx, plan, model_dir,
                       workload, rehearsal, Variant(backend))
        if run is not None:  # reported at once: a later run that fails loses nothing
            prefix = "" if backend == headline else f"{backend}."
            _report_engine_run(ctx, report, prefix, run, workload, hf, plan)


def _attempt(report: Report, what: str, run, *args):
    """``run(*args)``, or None with a failed check naming ``what`` and the error (the other runs
    go on: one that fails, a CUDA-graph capture say, must not lose the figures of the others)."""
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        report.check(f"{what} ran", False, f"{type(exc).__name__}: {exc}")
        return None


def _run_hf(model, workload: engine_workloads.Workload, batch_size: int):
    wrapped = OnDevice(model)
    engine_systems.hf_generate_batch(wrapped, [[3, 4, 5, 6]], 2)  # warm-up
    return engine_systems.run_hf_generate(wrapped, workload, batch_size)


def _report_engine_run(ctx, report, prefix, run, workload, hf, plan) -> None:
    result, steps, model_config = run
    limits = machine_limits(ctx, model_config)
    if "limit_source" not in report.figures:
        report.figure("limit_source", limits[2])
    bytes_per_param = torch.empty((), dtype=plan.dtype).element_size()
    cost = engine_limits.ModelCost.of(model_config, bytes_per_param)
    if not prefix:
        report.figure("backend", default_backend(ctx.device))
    report_run(report, prefix, result, steps, workload, cost, limits, hf)
