"""The systems ``bench_engine.py`` times on one workload: tpserve (every request at once, stepped
until all finish, KV waste sampled after each step), `transformers` static batching (``generate``
on left-padded batches) and its continuous batching (the manager ``generate_batch`` runs on)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from workers.engine import StepRecord
from workers.llm import LLM
from workers.sampling_params import SamplingParams

from scripts.engine.workloads import Workload


@dataclass
class RunResult:
    system: str
    wall_s: float
    outputs: List[List[int]]
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_tpserve(llm: LLM, workload: Workload) -> Tuple[RunResult, List[StepRecord]]:
    """Submit every request at once and step until all finish; KV waste sampled after each step."""
    engine = llm.engine
    first_record = len(engine.step_records)
    params = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
              for k in workload.max_tokens]
    outputs: Dict[str, List[int]] = {}
    usages, sampling_s = [], 0.0
    started = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(workload.prompts, params)]
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        sample_started = time.perf_counter()
        usages.append(engine.kv_usage())
        sampling_s += time.perf_counter() - sample_started
    wall_s = time.perf_counter() - started - sampling_s
    steps = engine.step_records[first_record:]
    result = RunResult("tpserve", wall_s, [outputs[i] for i in ids], _kv_waste(usages))
    result.extra["step_s"] = sum(r.duration_s for r in steps)
    return result, steps


def _kv_waste(usages) -> Dict[str, float]:
    allocated = sum(u.num_allocated_slots for u in usages)
    unfilled = sum(u.num_allocated_slots - u.num_filled_slots for u in usages)
    busy = [u.waste_frac for u in usages if u.num_allocated_slots]
    return {"kv_waste_frac": unfilled / allocated if allocated else 0.0,
            "kv_waste_frac_step_mean": sum(busy) / len(busy) if busy else 0.0,
            "kv_peak_usage": max((u.usage for u in usages), default=0.0)}


def load_hf(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def _pad_id(model) -> int:
    for value in (model.generation_config.pad_token_id, model.config.pad_token_id,
                  model.generation_config.eos_token_id):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


@torch.no_grad()
def hf_generate_batch(model, prompts: List[List[int]], max_new: int) -> List[List[int]]:
    """Greedy ``generate`` on one left-padded batch; exactly ``max_new`` tokens per row."""
    pad, width = _pad_id(model), max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, S]
    mask = torch.zeros_like(input_ids)  # [B, S]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist()


def run_hf_generate(model, workload: Workload, batch_size: int) -> RunResult:
    """Static batches sorted by prompt length; each runs to its longest output."""
    order = sorted(range(len(workload.prompts)), key=lambda i: -len(workload.prompts[i]))
    outputs: Dict[int, List[int]] = {}
    computed = 0
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        max_new = max(workload.max_tokens[i] for i in batch)
        rows = hf_generate_batch(model, [workload.prompts[i] for i in batch], max_new)
        computed += sum(len(r) for r in rows)
        for i, row in zip(batch, rows):
            outputs[i] = row[:workload.max_tokens[i]]
    wall_s = time.perf_counter() - started
    return RunResult("hf_generate", wall_s, [outputs[i] for i in range(len(order))],
                     {"computed_output_tokens": computed})


@torch.no_grad()
def run_hf_cb(model, workload: Workload) -> RunResult:
    """`transformers` continuous batching, each request with its own ``max_new_tokens``."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    config = GenerationConfig(max_new_tokens=max(workload.max_tokens), do_sample=False,
                              eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.max_tokens),
                          num_requests=len(workload.prompts))
    # A cache that holds the whole workload at once (no request waits for blocks), plus a block
    # a request to spare. Left to size it from free memory, the manager built a 14 GB attention
    # mask on CPU (8,192 x 439,040 fp32) and spent 20 s filling it before the first request.
    page = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(p) + k) // page) + 1
                 for p, k in zip(workload.prompts, workload.max_tokens))
    with model.continuous_batching_context_manager(
            generation_config=config, workload_hints=hints, block=True, timeout=30,
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks + 1)) as manager:
        _hf_cb_collect(manager, [[1, 2, 3, 4]], [2])  # warm-up inside the manager
        started = time.perf_counter()
        outputs = _hf_cb_collect(manager, workload.prompts, workload.max_tokens)
        wall_s = time.perf_counter() - started
    return RunResult("hf_cb", wall_s, outputs)


def _hf_cb_collect(manager, prompts: List[List[int]], max_tokens: List[int]) -> List[List[int]]:
    ids = [manager.add_request(p, max_new_tokens=k, eos_token_id=-1)
           for p, k in zip(prompts, max_tokens)]
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers continuous batching failed: {result.error}")
            results[result.request_id] = result.generated_tokens
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped before finishing")
    return [list(results[i]) for i in ids]
