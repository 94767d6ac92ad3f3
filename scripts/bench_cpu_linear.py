#!/usr/bin/env python3
"""Time bf16 linears on CPU, tpserve's kernel (``workers/models/bf16_linear.py``) against the oneDNN
linears it replaces on AVX-512 BF16 CPUs (``parallel.onednn_linear.PackedWeight``), in this
process.

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_cpu_linear [--rows 1,8,32,256]
        [--threads 1,2] [--layers 30] [--engine --rounds 2]

Kernel mode (the default): a model's layer linears (SmolLM2-135M's by default: QKV, O, gate/up
and down of hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64), ``--layers`` sets of
them with weights of their own, so that a pass streams them from memory as a decode step does:
milliseconds per pass (median of ``--reps``) through each path at each ``--rows`` and
``--threads``, their ratio, the weight bytes per second of the kernel, and the largest relative
difference of each from an fp32 product. ``--engine``: bench_vs_vllm's engine (bf16) and both
its workloads, the kernel and oneDNN swapped in alternating rounds in one engine: output tok/s
per arm and the ratio. The last line is JSON. Needs a CPU with AVX-512 BF16 and
``TPSERVE_CPU_KERNELS`` not 0 (exit 2 otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kv.native_build import switched_off
from parallel.cpu_capability import cpu_bf16_support
from parallel.onednn_linear import PackedWeight
from workers.models.bf16_linear import SWITCH_ENV, KernelWeight, build_kernel


def _ints(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=_ints, default=[1, 8, 32, 256], help="rows, comma-separated")
    p.add_argument("--threads", type=_ints, default=[1, 2], help="torch threads, comma-separated")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="weight sets a pass goes through")
    p.add_argument("--reps", type=int, default=7, help="timed passes per case")
    p.add_argument("--engine", action="store_true", help="the engine A/B instead")
    p.add_argument("--rounds", type=int, default=2, help="--engine: rounds per arm")
    args = p.parse_args(argv)
    if not args.rows or min(args.rows) < 1:
        p.error("--rows must be positive row counts")
    if not args.threads or min(args.threads + [args.layers, args.reps, args.rounds]) < 1:
        p.error("--threads, --layers, --reps and --rounds must be at least 1")
    if min(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim) < 1:
        p.error("--hidden, --intermediate, --heads, --kv-heads and --head-dim must be positive")
    return args


def layer_shapes(args: argparse.Namespace) -> List[Tuple[int, int]]:
    """``(out, in)`` of a layer's four linears."""
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return [(q + 2 * kv, args.hidden), (args.hidden, q), (2 * args.intermediate, args.hidden),
            (args.hidden, args.intermediate)]


def _median_ms(call: Callable[[], object], reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _max_error(packed, weight: torch.Tensor, x: torch.Tensor) -> float:
    want = x.float() @ weight.float().T
    return ((packed.linear(x).float() - want).abs() / want.abs().clamp_min(1.0)).max().item()


def kernel_cases(args: argparse.Namespace) -> List[Dict[str, float]]:
    gen = torch.Generator().manual_seed(0)
    shapes, kernel = layer_shapes(args), build_kernel()
    weights = [[torch.randn(shape, generator=gen).bfloat16() for shape in shapes]
               for _ in range(args.layers)]
    paths = {"kernel": [[KernelWeight(w, kernel) for w in layer] for layer in weights],
             "onednn": [[PackedWeight(w) for w in layer] for layer in weights]}
    weight_bytes = sum(out * inp * 2 for out, inp in shapes) * args.layers
    cases = []
    for rows in args.rows:
        inputs = {inp: torch.randn(rows, inp, generator=gen).bfloat16() for _, inp in shapes}
        for threads in args.threads:
            torch.set_num_threads(threads)
            ms = {}
            for name, layers in paths.items():
                def one_pass(layers=layers):
                    for layer in layers:
                        for packed, (_, inp) in zip(layer, shapes):
                            packed.linear(inputs[inp])
                ms[name] = _median_ms(one_pass, args.reps)
            errors = {name: _max_error(layers[0][2], weights[0][2], inputs[shapes[2][1]])
                      for name, layers in paths.items()}
            cases.append({"rows": rows, "threads": threads, "kernel_ms": round(ms["kernel"], 3),
                          "onednn_ms": round(ms["onednn"], 3),
                          "onednn_over_kernel": round(ms["onednn"] / ms["kernel"], 3),
                          "kernel_gb_s": round(weight_bytes / ms["kernel"] / 1e6, 2),
                          "kernel_max_error": errors["kernel"],
                          "onednn_max_error": errors["onednn"]})
    return cases


def engine_ab(args: argparse.Namespace) -> Dict[str, object]:
    from scripts.bench_vs_vllm import _resolve_model, build_engine, build_workloads
    from scripts.bench_vs_vllm import parse_args as vs_vllm_args
    from scripts.engine.systems import run_tpserve
    from scripts.traces import read_azure

    options = vs_vllm_args(["--dtypes", "bfloat16"])
    llm = build_engine(_resolve_model(options.model), "bfloat16")
    engine = llm.engine
    workloads = build_workloads(read_azure(options.trace, options.num_requests), options,
                                engine.max_model_len, engine.model_config.vocab_size)
    modules = [m for m in engine.rank.runner.model.modules()
               if isinstance(getattr(m, "packed", None), KernelWeight)]
    if not modules:
        raise SystemExit("error: the engine's linears do not run on the kernel here")
    arms = {"kernel": [m.packed for m in modules],
            "onednn": [PackedWeight(m.weight) for m in modules]}
    result: Dict[str, object] = {}
    try:
        for workload in workloads:
            rates: Dict[str, List[float]] = {name: [] for name in arms}
            run_tpserve(llm, workload)  # warm-up
            for round_index in range(args.rounds):
                order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
                for name in order:
                    for module, packed in zip(modules, arms[name]):
                        module.packed = packed
                    run, _ = run_tpserve(llm, workload)
                    rates[name].append(run.num_output_tokens / run.wall_s)
                    print(f"  {workload.name} round {round_index + 1} {name:<6} "
                          f"{rates[name][-1]:7.1f} tok/s", flush=True)
            medians = {name: statistics.median(values) for name, values in rates.items()}
            result[workload.name] = {"kernel_tok_s": medians["kernel"],
                                     "onednn_tok_s": medians["onednn"],
                                     "ratio": medians["kernel"] / medians["onednn"],
                                     "runs": rates}
    finally:
        for module, packed in zip(modules, arms["kernel"]):
            module.packed = packed
        llm.shutdown()
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if switched_off(SWITCH_ENV) or cpu_bf16_support().path not in ("amx", "avx512_bf16"):
        print(f"error: the bf16 linear kernel does not run here: it needs a CPU with avx512_bf16, "
              f"and {SWITCH_ENV} not 0", file=sys.stderr)
        return 2
    if args.engine:
        result = engine_ab(args)
        for name, figures in result.items():
            print(f"{name}: kernel {figures['kernel_tok_s']:.1f} tok/s, oneDNN "
                  f"{figures['onednn_tok_s']:.1f}: {figures['ratio']:.3f}x")
        print(json.dumps(result))
        return 0
    print(f"{'rows':>5} {'threads':>7} {'kernel ms':>9} {'oneDNN ms':>9} {'oneDNN/kernel':>13} "
          f"{'kernel GB/s':>11} {'kernel err':>10} {'oneDNN err':>10}")
    cases = kernel_cases(args)
    for case in cases:
        print(f"{case['rows']:>5} {case['threads']:>7} {case['kernel_ms']:>9.2f} "
              f"{case['onednn_ms']:>9.2f} {case['onednn_over_kernel']:>12.2f}x "
              f"{case['kernel_gb_s']:>11.1f} {case['kernel_max_error']:>10.2e} "
              f"{case['onednn_max_error']:>10.2e}")
    print(json.dumps({"cpu_bf16_path": cpu_bf16_support().path, "layers": args.layers,
                      "shapes": layer_shapes(args), "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
