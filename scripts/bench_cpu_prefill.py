#!/usr/bin/env python3
"""Time bf16 prefill attention on CPU, tpserve's kernel (``kv/attention/cpu_prefill.py``) against
the SDPA path it replaces (``kv.attention.torch_paged._attend_prefill``: K/V gathered, then
torch's CPU flash kernel), in this process.

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_cpu_prefill [--lengths 64,290,1024]
        [--prefix 0] [--threads 1,2] [--engine --rounds 3]

Kernel mode (the default): one sequence's prefill of each ``--lengths`` tokens after
``--prefix`` cached ones, over a paged cache of SmolLM2-135M's heads by default (9 query heads, 3
KV heads of 64), at each ``--threads``: microseconds per layer call (median of ``--reps``
timings of 20 calls) for both paths, their ratio, and the largest difference of each from fp32
SDPA. ``--engine``: bench_vs_vllm's engine and prefill-heavy workload, the kernel on and off in
alternating rounds in one engine: output tok/s per arm and the ratio. The last line is JSON.
Needs a CPU with AMX or AVX-512 BF16 (exit 2 otherwise); the kernel's products run on the first
it has.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

import kv.attention.torch_paged as torch_paged
from kv.attention.cpu_prefill import prefill_kernel, reference_prefill
from kv.attention.metadata import PrefillSlice


def _ints(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=_ints, default=[64, 290, 1024],
                   help="new tokens, comma-separated")
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before them")
    p.add_argument("--threads", type=_ints, default=[1, 2], help="torch threads, comma-separated")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64, choices=(64, 128))
    p.add_argument("--reps", type=int, default=15, help="timings per case (20 calls each)")
    p.add_argument("--engine", action="store_true", help="the engine A/B instead")
    p.add_argument("--rounds", type=int, default=3, help="--engine: rounds per arm")
    args = p.parse_args(argv)
    if not args.lengths or min(args.lengths) < 1 or args.prefix < 0:
        p.error("--lengths must be positive token counts and --prefix at least 0")
    if not args.threads or min(args.threads) < 1 or args.reps < 1 or args.rounds < 1:
        p.error("--threads, --reps and --rounds must be at least 1")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def _median_us(call: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(20):
            call()
        times.append((time.perf_counter() - start) / 20 * 1e6)
    return statistics.median(times)


def kernel_case(args: argparse.Namespace, length: int, threads: int) -> Dict[str, float]:
    gen = torch.Generator().manual_seed(length)
    keys = args.prefix + length
    num_slots = keys + 64
    k_cache, v_cache = (torch.randn(num_slots, args.kv_heads, args.head_dim, generator=gen)
                        .bfloat16() for _ in range(2))
    query = torch.randn(length, args.heads, args.head_dim, generator=gen).bfloat16()
    slots = torch.randperm(num_slots, generator=gen)[:keys]
    mask = None
    if args.prefix:  # the mask the metadata builds after a cached prefix
        mask = torch.ones(length, keys, dtype=torch.bool).tril(args.prefix)[None, None]
    prefill = PrefillSlice(0, length, slots, mask, args.prefix)
    scale, kernel = args.head_dim ** -0.5, prefill_kernel()
    out = torch.empty(length, args.heads * args.head_dim, dtype=torch.bfloat16)
    torch.set_num_threads(threads)
    kernel_us = _median_us(lambda: kernel.attend(query, k_cache, v_cache, prefill, scale, out),
                           args.reps)
    sdpa_us = _median_us(lambda: torch_paged._attend_prefill(query, k_cache, v_cache, prefill,
                                                             scale), args.reps)
    want = reference_prefill(query, k_cache, v_cache, prefill, scale)
    sdpa = torch_paged._attend_prefill(query, k_cache, v_cache, prefill, scale).float()
    return {"length": length, "threads": threads, "kernel_us": round(kernel_us, 1),
            "sdpa_us": round(sdpa_us, 1), "sdpa_over_kernel": round(sdpa_us / kernel_us, 3),
            "kernel_max_error": (out.float() - want).abs().max().item(),
            "sdpa_max_error": (sdpa - want).abs().max().item()}


def engine_ab(args: argparse.Namespace) -> Dict[str, object]:
    from scripts.bench_vs_vllm import _resolve_model, build_engine, build_workloads
    from scripts.bench_vs_vllm import parse_args as vs_vllm_args
    from scripts.engine.systems import run_tpserve
    from scripts.traces import read_azure

    options = vs_vllm_args(["--dtypes", "bfloat16"])
    llm = build_engine(_resolve_model(options.model), "bfloat16")
    engine = llm.engine
    workload = build_workloads(read_azure(options.trace, options.num_requests), options,
                               engine.max_model_len, engine.model_config.vocab_size)[0]
    kernel_arm = torch_paged._prefill_kernel
    arms = {"kernel": kernel_arm, "sdpa": lambda *tensors: None}
    rates: Dict[str, List[float]] = {name: [] for name in arms}
    try:
        run_tpserve(llm, workload)  # warm-up
        for round_index in range(args.rounds):
            order = list(arms) if round_index % 2 == 0 else list(arms)[::-1]
            for name in order:
                torch_paged._prefill_kernel = arms[name]
                result, _ = run_tpserve(llm, workload)
                rates[name].append(result.num_output_tokens / result.wall_s)
                print(f"  round {round_index + 1} {name:<6} {rates[name][-1]:7.1f} tok/s",
                      flush=True)
    finally:
        torch_paged._prefill_kernel = kernel_arm
        llm.shutdown()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"workload": workload.name, "kernel_tok_s": medians["kernel"],
            "sdpa_tok_s": medians["sdpa"], "ratio": medians["kernel"] / medians["sdpa"],
            "runs": rates}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if prefill_kernel() is None:
        print("error: the CPU prefill kernel does not run here: it needs a CPU with AMX (amx_bf16 "
              "and amx_tile) or avx512_bf16, and TPSERVE_CPU_KERNELS not 0", file=sys.stderr)
        return 2
    if args.engine:
        result = engine_ab(args)
        print(f"{result['workload']}: kernel {result['kernel_tok_s']:.1f} tok/s, SDPA "
              f"{result['sdpa_tok_s']:.1f}: {result['ratio']:.3f}x")
        print(json.dumps(result))
        return 0
    print(f"{'tokens':>6} {'threads':>7} {'kernel us':>10} {'SDPA us':>9} {'SDPA/kernel':>11} "
          f"{'kernel err':>10} {'SDPA err':>9}")
    cases = []
    for length in args.lengths:
        for threads in args.threads:
            case = kernel_case(args, length, threads)
            cases.append(case)
            print(f"{length:>6} {threads:>7} {case['kernel_us']:>10.1f} {case['sdpa_us']:>9.1f} "
                  f"{case['sdpa_over_kernel']:>10.2f}x {case['kernel_max_error']:>10.2e} "
                  f"{case['sdpa_max_error']:>9.2e}", flush=True)
    print(json.dumps({"products": prefill_kernel().products, "prefix": args.prefix,
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                      "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
