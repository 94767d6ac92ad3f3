"""Decode-steady section of ``scripts/gpu_check.py``: decode-heavy batches through the serial and
the overlapped step loop (``async_scheduling``), and where a decode step's time goes.

On CUDA: the throughput section's Llama-3.2-1B-shaped checkpoint in bf16, batches of 64 and 256
requests of 256 prompt and 512 output tokens (``ignore_eos``, greedy), every request submitted at
once; with ``--quick`` a tiny model and one batch of 4 of 16 / 16 tokens. One engine serves
every run (decode graphs captured once, up to the largest batch); each loop first runs the same
lengths with other token ids, so no timed step compiles or captures anything. Per batch and loop:

* ``ms_per_step``, ``tokens_per_s`` (output tokens over the wall time of the run);
* ``roofline_frac``: the time the run's steps take at the device's limit (as the throughput
  section costs them) over the wall time;
* ``gpu_busy_frac`` (CUDA): the device's time between each step's first and last queued work
  (events recorded around the model and the sampling) over the time from the first step's start
  to the last one's end: the share of the run the device had work queued;
* ``overlap_speedup``: the serial run's wall time over the overlapped one's.

Then, on CUDA: the host time of launching one decode-graph replay at the smaller batch, and an
overlapped run whose decode steps run under ``torch.cuda.set_sync_debug_mode("error")``: any
synchronizing call (a blocking copy, ``.item()``, a stream sync) fails it; the one wait per step
is an event's, which that mode does not count.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from scripts.engine import limits as engine_limits
from scripts.engine import workloads as engine_workloads
from scripts.gpu.common import CheckContext, Report, free_device_memory
from scripts.gpu.models import LLAMA_1B, TINY_TIED, build_checkpoint
from scripts.gpu.throughput import machine_limits
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams

LOOPS = (("serial", False), ("overlapped", True))


@dataclass(frozen=True)
class SteadyPlan:
    shape: dict
    dtype: torch.dtype
    batches: Tuple[int, ...]
    prompt_len: int
    output_len: int


def plan_for(ctx: CheckContext) -> SteadyPlan:
    if ctx.quick:
        return SteadyPlan(TINY_TIED, torch.bfloat16 if ctx.is_cuda else torch.float32, (4,),
                          16, 16)
    return SteadyPlan(LLAMA_1B, torch.bfloat16, (64, 256), 256, 512)


class StepEvents:
    """CUDA events around each step's device work: recorded before the model runs and after the
    sampling is queued (wrapping the engine's runner and sampler); none elsewhere."""

    def __init__(self, engine) -> None:
        self.pairs: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cuda = engine.rank_device.type == "cuda"
        self._start: Optional[torch.cuda.Event] = None
        runner, sampler = engine.rank.runner, engine._sampler
        execute, launch = runner.execute, sampler.launch

        def timed_execute(plan):
            if self._cuda and plan.seqs:
                self._start = _event()
            return execute(plan)

        def timed_launch(*args):
            launched = launch(*args)
            if self._start is not None:
                self.pairs.append((self._start, _event()))
                self._start = None
            return launched

        runner.execute, sampler.launch = timed_execute, timed_launch

    def busy_frac(self) -> Optional[float]:
        """Device time with work queued over the span of the recorded steps; None without."""
        if not self.pairs:
            return None
        torch.cuda.synchronize()
        busy = sum(start.elapsed_time(end) for start, end in self.pairs)
        return busy / self.pairs[0][0].elapsed_time(self.pairs[-1][1])


def _event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _workload(plan: SteadyPlan, batch: int, seed: int) -> engine_workloads.Workload:
    prompts = engine_workloads.random_prompts([plan.prompt_len] * batch,
                                              int(plan.shape["vocab_size"]), random.Random(seed))
    return engine_workloads.Workload("decode-steady", prompts, [plan.output_len] * batch)


def _run(llm: LLM, workload, sync_debug: bool = False):
    """(wall s, outputs in order, step records) of ``workload``, all submitted at once."""
    engine = llm.engine
    first = len(engine.step_records)
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for p, n in zip(workload.prompts, workload.max_tokens)]
    outputs = {}
    started = time.perf_counter()
    try:
        while engine.has_unfinished():
            steps = engine.step_records[first:]
            if sync_debug and steps and steps[-1].is_decode_only:
                torch.cuda.set_sync_debug_mode("error")
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.output_token_ids
    finally:
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
    wall = time.perf_counter() - started
    return wall, [outputs[i] for i in ids], engine.step_records[first:]


def check_decode_steady(ctx: CheckContext, report: Report) -> None:
    plan = plan_for(ctx)
    model_dir = ctx.workdir / "throughput"  # the throughput section's, when it ran
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, plan.shape, ctx.device.type, plan.dtype)
        free_device_memory()
    config = EngineConfig(model=str(model_dir), device=ctx.device.type,
                          dtype=str(plan.dtype).replace("torch.", ""),
                          max_model_len=plan.prompt_len + plan.output_len + 16,
                          max_num_seqs=max(plan.batches), record_steps=True,
                          enable_prefix_cache=False,  # the runs repeat their prompts
                          max_num_batched_tokens=max(2048, plan.prompt_len * 8),
                          kv_cache_gb=16.0 if ctx.is_cuda else 0.25)
    try:
        with LLM(config) as llm:
            _check_runs(ctx, report, plan, llm)
    finally:
        free_device_memory()


def _check_runs(ctx: CheckContext, report: Report, plan: SteadyPlan, llm: LLM) -> None:
    engine = llm.engine
    events = StepEvents(engine)
    limits = machine_limits(ctx, engine.model_config)
    cost = engine_limits.ModelCost.of(engine.model_config,
                                      torch.empty((), dtype=plan.dtype).element_size())
    for batch in plan.batches:
        walls, ids = {}, {}
        for name, overlap in LOOPS:
            engine.async_scheduling = overlap
            _run(llm, _workload(plan, batch, seed=1))  # the same shapes: nothing compiles later
            events.pairs.clear()
            wall, outputs, steps = _run(llm, _workload(plan, batch, seed=0))
            walls[name], ids[name] = wall, outputs
            prefix = f"b{batch}.{name}."
            report.check(f"{prefix}every request generated {plan.output_len} tokens",
                         all(len(o) == plan.output_len for o in outputs))
            limit_s = sum(cost.step_limit_s(s, limits[0], limits[1]) for s in steps)
            report.figure(prefix + "ms_per_step", 1000 * wall / len(steps), "ms")
            report.figure(prefix + "tokens_per_s", batch * plan.output_len / wall, "tok/s")
            report.figure(prefix + "roofline_frac", limit_s / wall)
            busy = events.busy_frac()
            if busy is not None:
                report.figure(prefix + "gpu_busy_frac", busy)
        report.check(f"b{batch}: the overlapped loop's ids equal the serial loop's",
                     ids["overlapped"] == ids["serial"])
        report.figure(f"b{batch}.overlap_speedup", walls["serial"] / walls["overlapped"])
    if not ctx.is_cuda:
        report.unavailable("gpu_busy_frac, graph replay, sync debug", "CUDA only")
        return
    graphs = engine.rank.runner.graphs
    if graphs is not None:
        size = min(s for s in graphs.sizes if s >= plan.batches[0])
        report.figure(f"graph_replay_host_us_b{size}", 1e6 * graphs.replay_host_s(size), "us")
    engine.async_scheduling = True
    try:
        _run(llm, _workload(plan, plan.batches[0], seed=2), sync_debug=True)
        report.check("no host sync in the overlapped decode steps but the event wait", True)
    except RuntimeError as exc:
        report.check("no host sync in the overlapped decode steps but the event wait", False,
                     f"{type(exc).__name__}: {str(exc)[:300]}")
