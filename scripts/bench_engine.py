"""Benchmark tpserve offline throughput against `transformers` and against the machine's limit.

Two workloads, built from seeded random token ids (valid ids of the model's vocabulary, no shared
prefixes, so the prefix cache never hits):

* prefill-heavy: the first N requests of an Azure LLM inference trace (CSV columns TIMESTAMP,
  ContextTokens, GeneratedTokens); prompt lengths are scaled by ``--prompt-scale`` (1/8) and output
  lengths by ``--output-scale`` (1: unscaled), then clamped to [1, context].
* decode-heavy: ``--decode-requests`` (32, which keeps the default run under 10 minutes on a
  shared 2-core machine) short prompts (16-48 tokens) with 64-128 new tokens each.

Every system generates exactly the requested number of tokens per request (tpserve with
``ignore_eos``, `transformers` with ``min_new_tokens`` or EOS disabled), greedy, in the model's
fp32 weights, in one process, one after another:

* tpserve: every request submitted at once, then the engine stepped until all finish.
* `transformers` static batching: ``generate`` on left-padded batches of ``--hf-batch-size``
  requests sorted by prompt length; each batch runs to its longest output (tokens beyond a
  request's own length are computed but not counted).
* `transformers` continuous batching: the manager that ``generate_batch`` runs on, fed with
  ``add_request`` so every request keeps its own ``max_new_tokens`` (``generate_batch`` takes one
  for all).

The machine's limit (roofline) for tpserve's exact steps. Measured here, in this process: the
memory read bandwidth ``B`` (sum of a 1 GiB fp32 tensor, best of 3) and the fp32 matmul rate ``R``
(best of a 2048^3 ``mm`` and a model-shaped linear, each through torch's default BLAS and through
the packed oneDNN linear tpserve runs on CPU, best of 3, all of torch's threads: the threads
the engine's ranks share), each measured before and after the runs and the better one kept (the
machine is shared; a load average above the core count means a run got less than all of it, so
every run prints the load average beside its time). For each executed step with ``T`` new tokens, ``L`` logits and, per
scheduled sequence, ``c`` tokens cached before the step and ``n`` new ones::

    bytes = P_lin * s + [L > 0] * V * H * s + sum(c + n) * kv_bytes_per_token
    flops = 2 * P_lin * T + 2 * V * H * L + 4 * layers * heads * head_dim * pairs
    pairs = sum(n * c + n * (n + 1) / 2)        (causal query-key pairs)
    t_step = max(bytes / B, flops / R)

``P_lin`` counts the parameters of every linear of every layer (q, k, v, o, gate, up, down), ``s``
the bytes per parameter, ``V * H`` the LM head read once per step that samples (embedding rows,
norms and activations are negligible);
``kv_bytes_per_token = 2 * layers * kv_heads * head_dim * s``.
``roofline_frac = sum(t_step) / tpserve wall time``: 1.0 is the machine's limit for this work.

KV waste: after every step, ``allocated - filled`` slots of the pool, summed over steps and divided
by allocated slots summed over steps (slot-weighted); the plain mean over steps is printed too.
The last line printed is one JSON object with every figure; ``--steps-out`` writes every step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:  # imported by path (tests): the trace readers live beside it
    sys.path.insert(0, str(SCRIPTS))

import torch  # noqa: E402

from parallel.onednn_linear import PackedWeight, can_pack  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import StepRecord  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.model_config import ModelConfig  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

from traces import AZURE_CODE_TRACE, TraceError, TraceRequest, read_azure  # noqa: E402

DEFAULT_TRACE = AZURE_CODE_TRACE
DECODE_PROMPT_RANGE = (16, 48)
DECODE_OUTPUT_RANGE = (64, 128)
DEFAULT_DECODE_REQUESTS = 32  # keeps the default run under 10 minutes on a shared 2-core host


class BenchInputError(ValueError):
    """Bad input from the command line; printed without a traceback (as is a ``TraceError``)."""


# ----- workloads -----


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: List[List[int]]
    max_tokens: List[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def clamp_lengths(prompt_len: int, output_len: int, max_model_len: int,
                  max_output: Optional[int]) -> Tuple[int, int]:
    """Fit one request in the context: 1 <= output <= max_output, 1 <= prompt, sum <= context."""
    cap = max_model_len - 1 if max_output is None else min(max_output, max_model_len - 1)
    output_len = max(1, min(output_len, cap))
    prompt_len = max(1, min(prompt_len, max_model_len - output_len))
    return prompt_len, output_len


def random_prompts(lengths: Sequence[int], vocab_size: int, rng: random.Random) -> List[List[int]]:
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def prefill_workload(rows: Sequence[TraceRequest], args: argparse.Namespace,
                     max_model_len: int, vocab_size: int) -> Workload:
    lengths = [clamp_lengths(round(r.num_prompt_tokens * args.prompt_scale),
                             round(r.num_output_tokens * args.output_scale), max_model_len,
                             args.max_output) for r in rows]
    rng = random.Random(args.seed)
    return Workload("prefill-heavy", random_prompts([p for p, _ in lengths], vocab_size, rng),
                    [o for _, o in lengths])


def decode_workload(args: argparse.Namespace, max_model_len: int, vocab_size: int) -> Workload:
    rng = random.Random(args.seed + 1)
    lengths = [clamp_lengths(rng.randint(*DECODE_PROMPT_RANGE), rng.randint(*DECODE_OUTPUT_RANGE),
                             max_model_len, args.max_output)
               for _ in range(args.decode_requests)]
    return Workload("decode-heavy", random_prompts([p for p, _ in lengths], vocab_size, rng),
                    [o for _, o in lengths])


# ----- the machine's limits -----


def _best_of(fn, repeats: int = 3) -> float:
    """Shortest wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_read_gbps(gib: float = 1.0) -> float:
    """Memory read bandwidth: bytes of a ``gib`` GiB fp32 tensor over the best time to sum it."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    seconds = _best_of(lambda: x.sum().item())
    return x.numel() * 4 / seconds / 1e9


def measure_matmul_gflops(model: ModelConfig) -> Tuple[float, float]:
    """fp32 rates of a 2048^3 product and of the model's MLP up-projection on 2048 tokens, each
    the better of torch's ``mm``/``linear`` and the packed oneDNN linear that tpserve's CPU
    layers run (``parallel/onednn_linear.py``; on some CPUs twice MKL's rate)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    square = 2 * 2048 ** 3 / min(_best_of(lambda: torch.mm(a, b)), _packed_s(a, b.T)) / 1e9
    x = torch.randn(2048, model.hidden_size)  # [T, H]
    w = torch.randn(model.intermediate_size, model.hidden_size)  # [I, H]
    flops = 2 * 2048 * model.hidden_size * model.intermediate_size
    shaped = flops / min(_best_of(lambda: torch.nn.functional.linear(x, w)), _packed_s(x, w)) / 1e9
    return square, shaped


def _packed_s(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Best time of ``x @ weight.T`` through a packed oneDNN weight (inf where unavailable)."""
    if not can_pack(weight):
        return float("inf")
    packed = PackedWeight(weight)
    return _best_of(lambda: packed.linear(x))


# ----- roofline -----


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of the model's parts (see the module docstring)."""

    linear_params: int
    lm_head_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int
    bytes_per_param: int

    @classmethod
    def of(cls, m: ModelConfig, bytes_per_param: int) -> "ModelCost":
        q_and_o = 2 * m.hidden_size * m.num_heads * m.head_dim
        k_and_v = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
        mlp = 3 * m.hidden_size * m.intermediate_size
        return cls(linear_params=m.num_layers * (q_and_o + k_and_v + mlp),
                   lm_head_params=m.vocab_size * m.hidden_size,
                   kv_bytes_per_token=2 * m.num_layers * m.num_kv_heads * m.head_dim
                   * bytes_per_param,
                   attn_flops_per_pair=4 * m.num_layers * m.num_heads * m.head_dim,
                   bytes_per_param=bytes_per_param)

    def step_bytes(self, step: StepRecord) -> float:
        weights = self.linear_params + (self.lm_head_params if step.num_logits else 0)
        kv_tokens = sum(c + n for c, n in step.seqs)
        return weights * self.bytes_per_param + kv_tokens * self.kv_bytes_per_token

    def step_flops(self, step: StepRecord) -> float:
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in step.seqs)
        return (2 * self.linear_params * step.num_tokens + 2 * self.lm_head_params
                * step.num_logits + self.attn_flops_per_pair * pairs)

    def step_limit_s(self, step: StepRecord, read_gbps: float, matmul_gflops: float) -> float:
        return max(self.step_bytes(step) / (read_gbps * 1e9),
                   self.step_flops(step) / (matmul_gflops * 1e9))


# ----- systems -----


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
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    config = GenerationConfig(max_new_tokens=max(workload.max_tokens), do_sample=False,
                              eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.max_tokens),
                          num_requests=len(workload.prompts))
    with model.continuous_batching_context_manager(generation_config=config, workload_hints=hints,
                                                   block=True, timeout=30) as manager:
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


# ----- one workload, all systems -----


@dataclass
class WorkloadReport:
    workload: Workload
    tpserve: RunResult
    steps: List[StepRecord]
    baselines: Dict[str, RunResult]
    step_limits_s: List[float] = field(default_factory=list)  # per step, at the machine's limit

    def compute_limits(self, cost: ModelCost, machine: Dict[str, float]) -> None:
        self.step_limits_s = [cost.step_limit_s(s, machine["read_gbps"], machine["matmul_gflops"])
                              for s in self.steps]

    @property
    def limit_s(self) -> float:
        return sum(self.step_limits_s)

    def tokens_per_s(self, result: RunResult) -> float:
        return result.num_output_tokens / result.wall_s

    def total_tokens_per_s(self, result: RunResult) -> float:
        return (self.workload.num_prompt_tokens + result.num_output_tokens) / result.wall_s


def run_workload(workload: Workload, llm: LLM, hf_model,
                 args: argparse.Namespace, threads: int) -> WorkloadReport:
    print(f"\n== {workload.name}: {len(workload.prompts)} requests, "
          f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens",
          flush=True)
    result, steps = run_tpserve(llm, workload)
    _note_load(result)
    torch.set_num_threads(threads)  # a TP rank in this process may have lowered it
    baselines: Dict[str, RunResult] = {}
    if hf_model is not None:
        baselines["hf_generate"] = _note_load(run_hf_generate(hf_model, workload,
                                                              args.hf_batch_size))
        baselines["hf_cb"] = _note_load(run_hf_cb(hf_model, workload))
    return WorkloadReport(workload, result, steps, baselines)


def _note_load(result: RunResult) -> RunResult:
    """Keep the 1-minute load average (this run's own threads included) beside the time: the
    machine is shared, and a load above the core count means the run got less than all of it."""
    result.extra["load_average"] = os.getloadavg()[0]
    print(f"  {result.system:<12}{result.wall_s:8.1f} s  (load average "
          f"{result.extra['load_average']:.1f})", flush=True)
    return result


# ----- reporting -----


def print_table(report: WorkloadReport) -> None:
    w, tp = report.workload, report.tpserve
    print(f"\n{w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt tokens, "
          f"{w.num_output_tokens} output tokens requested")
    print(f"  {'system':<16}{'wall s':>9}{'out tok':>9}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'wall/tpserve':>14}{'same ids':>10}{'load':>6}")
    limit_tps = tp.num_output_tokens / report.limit_s
    print(f"  {'machine limit':<16}{report.limit_s:>9.1f}{tp.num_output_tokens:>9}"
          f"{limit_tps:>11.1f}{'':>13}{report.limit_s / tp.wall_s:>14.2f}")
    for result in [tp, *report.baselines.values()]:
        same = sum(a == b for a, b in zip(result.outputs, tp.outputs)) / len(tp.outputs)
        print(f"  {result.system:<16}{result.wall_s:>9.1f}{result.num_output_tokens:>9}"
              f"{report.tokens_per_s(result):>11.1f}{report.total_tokens_per_s(result):>13.1f}"
              f"{result.wall_s / tp.wall_s:>14.2f}{same:>10.0%}"
              f"{result.extra['load_average']:>6.1f}")
    counts = {r.system: r.num_output_tokens for r in [tp, *report.baselines.values()]}
    print(f"  output tokens generated: {counts}: "
          f"{'equal' if len(set(counts.values())) == 1 else 'NOT EQUAL'}")
    _print_step_breakdown(report)
    print(f"  KV waste {tp.extra['kv_waste_frac']:.2%} of allocated slots (slot-weighted over "
          f"steps; step mean {tp.extra['kv_waste_frac_step_mean']:.2%}), peak pool use "
          f"{tp.extra['kv_peak_usage']:.1%}")
    if "hf_generate" in report.baselines:
        computed = report.baselines["hf_generate"].extra["computed_output_tokens"]
        print(f"  hf_generate computed {computed:.0f} output tokens (batches run to their "
              f"longest output), counted {report.baselines['hf_generate'].num_output_tokens}")


def _print_step_breakdown(report: WorkloadReport) -> None:
    pairs = list(zip(report.steps, report.step_limits_s))
    groups = {"with prefill": [(s, t) for s, t in pairs if not s.is_decode_only],
              "decode only": [(s, t) for s, t in pairs if s.is_decode_only]}
    overhead = report.tpserve.wall_s - report.tpserve.extra["step_s"]
    print(f"  tpserve steps: {len(report.steps)}; outside steps {overhead:.2f} s "
          f"(tokenize, add_request, loop)")
    for name, steps in groups.items():
        if steps:
            measured = sum(s.duration_s for s, _ in steps)
            limit = sum(t for _, t in steps)
            print(f"    {name:<13} {len(steps):>5} steps {sum(s.num_tokens for s, _ in steps):>7} "
                  f"tokens  measured {measured:7.2f} s  at limit {limit:7.2f} s  "
                  f"({limit / measured:.0%})")


def write_steps(path: Path, reports: Sequence[WorkloadReport]) -> None:
    with open(path, "w") as f:
        for report in reports:
            for step, limit_s in zip(report.steps, report.step_limits_s):
                f.write(json.dumps({"workload": report.workload.name, "seqs": step.seqs,
                                    "num_logits": step.num_logits,
                                    "duration_s": step.duration_s, "limit_s": limit_s}) + "\n")
    print(f"steps written to {path}")


def summary(report: WorkloadReport, prefix: str) -> Dict[str, object]:
    tp = report.tpserve
    tps = report.tokens_per_s(tp)
    figures: Dict[str, object] = {
        "tokens_per_s": tps,
        "total_tokens_per_s": report.total_tokens_per_s(tp),
        "limit_tokens_per_s": tp.num_output_tokens / report.limit_s,
        "roofline_frac": report.limit_s / tp.wall_s,
        "kv_waste_frac": tp.extra["kv_waste_frac"],
        "kv_waste_frac_step_mean": tp.extra["kv_waste_frac_step_mean"],
        "wall_s": tp.wall_s,
        "prompt_tokens": report.workload.num_prompt_tokens,
        "output_tokens": tp.num_output_tokens,
        "num_steps": len(report.steps),
    }
    for name in ("hf_generate", "hf_cb"):
        result = report.baselines.get(name)
        rate = report.tokens_per_s(result) if result else None
        figures[f"{name}_tokens_per_s"] = rate
        figures[f"ratio_vs_{name}"] = tps / rate if rate else None
        figures[f"{name}_output_tokens"] = result.num_output_tokens if result else None
    return {f"{prefix}{k}": v for k, v in figures.items()}


# ----- main -----


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="Azure-format CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    p.add_argument("--num-requests", type=int, default=64, help="prefill-heavy requests")
    p.add_argument("--decode-requests", type=int, default=None,
                   help=f"decode-heavy requests (default: min({DEFAULT_DECODE_REQUESTS}, "
                        f"--num-requests))")
    p.add_argument("--prompt-scale", type=float, default=1 / 8, help="trace prompt lengths x")
    p.add_argument("--output-scale", type=float, default=1.0, help="trace output lengths x")
    p.add_argument("--max-output", type=int, default=None, help="cap every output length")
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of tpserve")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers generate batch")
    p.add_argument("--skip-hf", action="store_true", help="run tpserve and the limit only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-out", type=Path, default=None,
                   help="write every tpserve step (per-sequence cached/new tokens, measured and "
                        "limit seconds) to this JSON-lines file")
    args = p.parse_args(argv)
    if args.decode_requests is None:
        args.decode_requests = min(DEFAULT_DECODE_REQUESTS, args.num_requests)
    for name in ("num_requests", "decode_requests", "hf_batch_size", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_output is not None and args.max_output < 1:
        p.error("--max-output must be at least 1")
    if args.prompt_scale <= 0 or args.output_scale <= 0:
        p.error("--prompt-scale and --output-scale must be positive")
    return args


def measure_machine(model: ModelConfig, when: str) -> Dict[str, float]:
    square, shaped = measure_matmul_gflops(model)
    machine = {"read_gbps": measure_read_gbps(), "mm2048_gflops": square,
               "linear_gflops": shaped}
    print(f"machine {when} ({torch.get_num_threads()} torch threads, load average "
          f"{os.getloadavg()[0]:.1f}): read {machine['read_gbps']:.1f} GB/s (1 GiB sum), fp32 "
          f"matmul {square:.1f} GFLOP/s (2048^3), {shaped:.1f} GFLOP/s (model-shaped linear), "
          f"each the better of torch's BLAS and oneDNN",
          flush=True)
    return machine


def best_machine(first: Dict[str, float], last: Dict[str, float]) -> Dict[str, float]:
    """The machine's limit is its best: take each rate's maximum over both measurements."""
    best = {k: max(first[k], last[k]) for k in first}
    best["matmul_gflops"] = max(best["mm2048_gflops"], best["linear_gflops"])
    print(f"the limit uses read {best['read_gbps']:.1f} GB/s and matmul "
          f"{best['matmul_gflops']:.1f} GFLOP/s (the best of both measurements)")
    return best


def build_engine(args: argparse.Namespace) -> LLM:
    try:
        llm = LLM(EngineConfig(model=args.model, tp_size=args.tp, block_size=args.block_size,
                               record_steps=True))
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {args.model} --tp {args.tp}: {exc}") from None
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return llm


def build_workloads(rows, args, max_model_len: int, vocab_size: int) -> List[Workload]:
    workloads = [prefill_workload(rows, args, max_model_len, vocab_size),
                 decode_workload(args, max_model_len, vocab_size)]
    print(f"prefill-heavy: first {args.num_requests} requests of {args.trace}; prompt lengths "
          f"x{args.prompt_scale:g}, output lengths x{args.output_scale:g}, clamped to [1, "
          f"{max_model_len}] (output cap {args.max_output}); random token ids, seed {args.seed}")
    print(f"decode-heavy: {args.decode_requests} requests, prompts {DECODE_PROMPT_RANGE}, "
          f"outputs {DECODE_OUTPUT_RANGE} tokens (output cap {args.max_output})", flush=True)
    return workloads


def run(args: argparse.Namespace) -> Dict[str, object]:
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    rows = read_azure(args.trace, args.num_requests)  # bad files fail before any model loads
    threads = torch.get_num_threads()
    llm = build_engine(args)
    torch.set_num_threads(threads)
    try:
        engine = llm.engine
        first = measure_machine(engine.model_config, "before")
        workloads = build_workloads(rows, args, engine.max_model_len,
                                    engine.model_config.vocab_size)
        hf_model = None if args.skip_hf else _warm_hf(engine.model_dir)
        reports = [run_workload(w, llm, hf_model, args, threads) for w in workloads]
    finally:
        llm.shutdown()
    torch.set_num_threads(threads)
    machine = best_machine(first, measure_machine(engine.model_config, "after"))
    cost = ModelCost.of(engine.model_config, _bytes_per_param(llm))
    for report in reports:
        report.compute_limits(cost, machine)
        print_table(report)
    if args.steps_out is not None:
        write_steps(args.steps_out, reports)
    return {"model": Path(engine.model_dir).name, "tp": args.tp,
            "num_requests": args.num_requests, "decode_num_requests": args.decode_requests,
            "prompt_scale": args.prompt_scale, "output_scale": args.output_scale,
            "hf_batch_size": args.hf_batch_size, **summary(reports[0], ""),
            **summary(reports[1], "decode_"), **machine, "torch_threads": threads,
            "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
            "bench_wall_s": time.perf_counter() - started}


def _bytes_per_param(llm: LLM) -> int:
    from workers.rank import resolve_dtype

    config, model = llm.engine.config, llm.engine.model_config
    device = torch.device("cuda" if torch.cuda.is_available() and config.device != "cpu"
                          else "cpu")
    dtype = resolve_dtype(config.dtype, device, model.torch_dtype)
    return torch.empty((), dtype=dtype).element_size()


def _warm_hf(model_dir: Path):
    model = load_hf(model_dir)
    hf_generate_batch(model, [[1, 2, 3, 4]], 2)
    return model


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (BenchInputError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
