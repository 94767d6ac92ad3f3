#!/usr/bin/env python3
"""Time CPU decode attention, the C kernel (``kv/attention/cpu_decode.py``) against the PyTorch path it
replaces (gather K/V into padded dense tensors, then SDPA, in buckets of 16 decodes), on one
step's decodes over every layer's cache, in this process.

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_cpu_decode [--seqs 32] [--layers 30]
        [--dtype bfloat16]

The step: ``--seqs`` sequences of ``--min-keys``..``--max-keys`` cached tokens (the decode-heavy
workload of ``bench_engine.py`` holds 32 of 16-176), in blocks of ``--block-size`` slots scattered
over a pool, each layer with a cache of its own, shaped as SmolLM2-135M's by default (9 query
heads, 3 KV heads of 64). Hot: one layer's cache attended again and again; cold: the layers in
turn, so each call finds its K/V out of the caches, as a decode step does (every layer's weights
stream through them in between). The figures are microseconds per layer call (median of
``--reps`` passes), the K/V bytes read per second, and the PyTorch path's time over the
kernel's. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]

from kv.attention.metadata import (DECODE_BUCKET_SIZE, SeqSlice,  # noqa: E402
                                   build_attention_metadata)
from kv.attention.cpu_decode import decode_kernel, reference_attend  # noqa: E402


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=32, help="decodes in the step")
    p.add_argument("--min-keys", type=int, default=40, help="fewest cached tokens of a sequence")
    p.add_argument("--max-keys", type=int, default=170, help="most cached tokens of a sequence")
    p.add_argument("--layers", type=int, default=30, help="caches attended in turn (cold)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20, help="timed passes over the layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the caches' and queries' dtype")
    args = p.parse_args(argv)
    for name in ("seqs", "min_keys", "layers", "heads", "kv_heads", "head_dim", "block_size",
                 "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_keys < args.min_keys:
        p.error("--max-keys must be at least --min-keys")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    return args


class Step:
    """One decode step's queries, and its decodes' key slots and masks in buckets as each path
    gets them (the kernel: one bucket; PyTorch: buckets of ``DECODE_BUCKET_SIZE``, each padded
    to its longest context); each layer's (K, V) caches."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        torch.manual_seed(args.seed)
        lengths = [rng.randint(args.min_keys, args.max_keys) for _ in range(args.seqs)]
        num_blocks = 4 * sum(-(-(n + 1) // args.block_size) for n in lengths)  # a quarter used
        free = list(range(num_blocks))
        rng.shuffle(free)  # each sequence's blocks scattered over the pool
        seqs = [SeqSlice(1, n, [free.pop() for _ in range(-(-(n + 1) // args.block_size))])
                for n in lengths]
        cpu = torch.device("cpu")
        self.buckets = {size: build_attention_metadata(seqs, args.block_size, cpu, None,
                                                       size).buckets
                        for size in (None, DECODE_BUCKET_SIZE)}
        shape = (num_blocks * args.block_size, args.kv_heads, args.head_dim)
        dtype = getattr(torch, args.dtype)
        self.caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
                       for _ in range(args.layers)]
        self.query = torch.randn(args.seqs, args.kv_heads, args.heads // args.kv_heads,
                                 args.head_dim).to(dtype)
        self.scale = args.head_dim ** -0.5
        self.kv_bytes = (sum(n + 1 for n in lengths) * 2 * args.kv_heads * args.head_dim
                         * dtype.itemsize)

    def attend(self, path: Callable, bucket_size: Optional[int], layer: int) -> torch.Tensor:
        """Every decode's output, ``[B, Hkv, G, D]`` in sequence order."""
        k_cache, v_cache = self.caches[layer]
        out = torch.empty_like(self.query)
        for bucket in self.buckets[bucket_size]:
            num_seqs = bucket.token_index.shape[0]
            q = self.query.index_select(0, bucket.token_index)
            out[bucket.token_index] = path(q, k_cache, v_cache, bucket.kv_slots,
                                           bucket.mask.view(num_seqs, -1), self.scale)
        return out


def time_path(step: Step, path: Callable, bucket_size: Optional[int], cold: bool,
              reps: int) -> float:
    """Median microseconds of one layer's decodes: a pass attends every layer (cold) or the
    first one as often (hot)."""
    num_layers = len(step.caches)
    layers = range(num_layers) if cold else [0] * num_layers
    for layer in layers:  # warm-up
        step.attend(path, bucket_size, layer)
    per_call = []
    for _ in range(reps):
        start = time.perf_counter()
        for layer in layers:
            step.attend(path, bucket_size, layer)
        per_call.append((time.perf_counter() - start) / num_layers * 1e6)
    return statistics.median(per_call)


def run(args: argparse.Namespace) -> Dict[str, object]:
    kernel = decode_kernel()
    if kernel is None:
        raise SystemExit("error: the C decode kernel cannot be built here (see the log line "
                         "above); nothing to compare")
    step = Step(args)
    paths = ((kernel.attend, None), (reference_attend, DECODE_BUCKET_SIZE))
    error = (step.attend(*paths[0], 0).float()
             - step.attend(*paths[1], 0).float()).abs().max().item()
    figures: Dict[str, object] = {"seqs": args.seqs, "dtype": args.dtype, "kv_bytes_per_layer": step.kv_bytes,
                                  "max_abs_error": error, "torch_threads": torch.get_num_threads()}
    print(f"{args.seqs} decodes, {step.kv_bytes / 1e6:.2f} MB of K/V a layer, {args.layers} "
          f"layers; max abs difference kernel vs PyTorch {error:.1e}")
    print(f"{'mode':>5} {'kernel us':>10} {'GB/s':>6} {'pytorch us':>11} {'GB/s':>6} "
          f"{'pytorch/kernel':>15}")
    for mode in ("hot", "cold"):
        times: List[float] = [time_path(step, path, size, mode == "cold", args.reps)
                              for path, size in paths]
        ratio = times[1] / times[0]
        print(f"{mode:>5} {times[0]:10.1f} {step.kv_bytes / times[0] / 1e3:6.1f} "
              f"{times[1]:11.1f} {step.kv_bytes / times[1] / 1e3:6.1f} {ratio:15.2f}", flush=True)
        figures[f"kernel_us_{mode}"] = round(times[0], 1)
        figures[f"pytorch_us_{mode}"] = round(times[1], 1)
        figures[f"pytorch_over_kernel_{mode}"] = round(ratio, 3)
    return figures


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
