"""Benchmark tpserve offline throughput against `transformers` and against the machine's limit.

Two workloads, built from seeded random token ids (valid ids of the model's vocabulary, no shared
prefixes, so the prefix cache never hits):

* prefill-heavy: the first N requests of an Azure LLM inference trace (CSV columns TIMESTAMP,
  ContextTokens, GeneratedTokens); prompt lengths are scaled by ``--prompt-scale`` (1/8) and output
  lengths by ``--output-scale`` (1: unscaled), then clamped to [1, context].
* decode-heavy: ``--decode-requests`` (32, which keeps the default run under 10 minutes on a
  shared 2-core machine) short prompts (16-48 tokens) with 64-128 new tokens each.

Every system generates exactly the requested number of tokens per request (tpserve with
``ignore_eos``, `transformers` with ``min_new_tokens`` or EOS disabled), greedy, in one process,
one after another; `transformers` in fp32, tpserve in ``--dtype`` (default ``auto``: bf16 on a CPU
with AMX or AVX-512 BF16, else fp32; the roofline's matmul rate ``R`` is fp32's either way):

* tpserve: every request submitted at once, then the engine stepped until all finish.
* `transformers` static batching: ``generate`` on left-padded batches of ``--hf-batch-size``
  requests sorted by prompt length; each batch runs to its longest output (tokens beyond a
  request's own length are computed but not counted).
* `transformers` continuous batching: the manager that ``generate_batch`` runs on, fed with
  ``add_request`` so every request keeps its own ``max_new_tokens`` (``generate_batch`` takes one
  for all), its cache sized to hold the whole workload at once (``num_blocks``).

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
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCRIPTS = Path(__file__).resolve().parent

import torch  # noqa: E402

import kv.attention.cpu_decode as cpu_decode  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

from scripts.engine.limits import ModelCost, best_machine, measure_machine  # noqa: E402
from scripts.engine.report import WorkloadReport, print_table, summary, write_steps  # noqa: E402
from scripts.engine.structured import (  # noqa: E402
    add_arguments as add_structured_arguments,
    check_arguments as check_structured_arguments,
    run_structured,
)
from scripts.engine.systems import (  # noqa: E402
    RunResult,
    hf_generate_batch,
    load_hf,
    run_hf_cb,
    run_hf_generate,
    run_tpserve,
)
from scripts.engine.workloads import (  # noqa: E402
    DECODE_OUTPUT_RANGE,
    DECODE_PROMPT_RANGE,
    Workload,
    decode_workload,
    prefill_workload,
)
from scripts.traces import AZURE_CODE_TRACE, TraceError, read_azure  # noqa: E402

DEFAULT_TRACE = AZURE_CODE_TRACE
DEFAULT_DECODE_REQUESTS = 32  # keeps the default run under 10 minutes on a shared 2-core host


class BenchInputError(ValueError):
    """Bad input from the command line; printed without a traceback (as is a ``TraceError``)."""


# ----- one workload, all systems -----


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
    p.add_argument("--dtype", default="auto", help="tpserve's dtype: auto, float32 or bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers generate batch")
    p.add_argument("--skip-hf", action="store_true", help="run tpserve and the limit only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps-out", type=Path, default=None,
                   help="write every tpserve step (per-sequence cached/new tokens, measured and "
                        "limit seconds) to this JSON-lines file")
    add_structured_arguments(p)
    args = p.parse_args(argv)
    check_structured_arguments(p, args)
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


def build_engine(args: argparse.Namespace) -> LLM:
    try:
        llm = LLM(EngineConfig(model=args.model, tp_size=args.tp, block_size=args.block_size,
                               dtype=args.dtype, record_steps=True))
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {args.model} --tp {args.tp} --dtype {args.dtype}: "
                              f"{exc}") from None
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


def run_structured_bench(args: argparse.Namespace) -> Dict[str, object]:
    """``--structured``: `scripts.engine.structured` on the model, nothing else."""
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    llm = build_engine(args)
    print(f"--structured: {args.structured_batch} requests, half constrained by a JSON schema; "
          f"{torch.get_num_threads()} torch threads", flush=True)
    try:
        result = run_structured(llm, args)
    finally:
        llm.shutdown()
    return {"model": Path(llm.engine.model_dir).name, "tp": args.tp, **result,
            "torch_threads": torch.get_num_threads(), "load_average_start": load_start,
            "load_average_end": os.getloadavg()[0],
            "bench_wall_s": time.perf_counter() - started}


def run(args: argparse.Namespace) -> Dict[str, object]:
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    rows = read_azure(args.trace, args.num_requests)  # bad files fail before any model loads
    threads = torch.get_num_threads()
    llm = build_engine(args)
    torch.set_num_threads(threads)
    on_kernel = cpu_decode.decode_kernel() is not None  # what this process's ranks run
    print(f"CPU decodes: {'the C kernel' if on_kernel else 'the PyTorch path'} "
          f"(kv/attention/cpu_decode.py); tpserve in {_resolved_dtype(llm)}")
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
            "dtype": str(_resolved_dtype(llm)).replace("torch.", ""),
            "num_requests": args.num_requests, "decode_num_requests": args.decode_requests,
            "prompt_scale": args.prompt_scale, "output_scale": args.output_scale,
            "hf_batch_size": args.hf_batch_size, **summary(reports[0], ""),
            **summary(reports[1], "decode_"), **machine, "torch_threads": threads,
            "cpu_decode_kernel": on_kernel,
            "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
            "bench_wall_s": time.perf_counter() - started}


def _bytes_per_param(llm: LLM) -> int:
    return torch.empty((), dtype=_resolved_dtype(llm)).element_size()


def _resolved_dtype(llm: LLM) -> torch.dtype:
    """The dtype tpserve's ranks compute in (``--dtype`` resolved as the engine resolves it)."""
    from workers.rank import resolve_dtype

    config, model = llm.engine.config, llm.engine.model_config
    device = torch.device("cuda" if torch.cuda.is_available() and config.device != "cpu"
                          else "cpu")
    return resolve_dtype(config.dtype, device, model.torch_dtype)


def _warm_hf(model_dir: Path):
    model = load_hf(model_dir)
    hf_generate_batch(model, [[1, 2, 3, 4]], 2)
    return model


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = run_structured_bench(args) if args.structured else run(args)
    except (BenchInputError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
