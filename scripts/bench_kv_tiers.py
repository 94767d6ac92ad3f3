"""Benchmark the KV tiers below the device pool: copy and disk bandwidth, prefix hits on a trace.

Three parts, in one process, one after another:

(a) Host copies. One rank's tier machinery (``KVCache``, ``HostBuffer``, ``TransferEngine``) with
    the KV shape of ``--model`` at TP 1 moves ``--copy-blocks`` blocks per batch: one ``submit`` of
    that many ``Spill`` ops (device -> host, each block's xxh3 checksum computed), wait; then as
    many ``Restore`` ops (host -> device, each block checked against its checksum). The baseline
    is one plain ``copy_`` of the same blocks between the same pool and host buffer (permuted
    views: the same bytes and pages, torch's threads, no checksum); a ``copy_`` between two fresh
    contiguous float32 tensors of the same size is printed too, for information (its pages moved
    17.5 GB/s one way and 30.5 the other in one run here: it measures pages, not the tier).
    The contenders take turns (which runs first rotates), each after a 10 ms pause (torch's
    OpenMP workers spin for milliseconds after a ``copy_``; see ``scripts/tiers/bandwidth.py``),
    ``--repeats`` times after one warm-up round; medians are reported. ``host_copy_ratio`` is
    the lower of the two directions' ratios (tier GB/s / same-buffer ``copy_`` GB/s).
(b) Disk. ``--disk-blocks`` consecutive disk slots written from and read back into host slots
    through the same ``TransferEngine`` (``WriteDisk`` / ``ReadDisk``: ``DiskStore`` coalesces
    them into 8 MiB ``O_DIRECT`` calls; reads verify checksums), against a raw loop over the same
    bytes on the same filesystem: a separate ``O_DIRECT`` file, ``os.pwrite`` then ``os.preadv``
    of 8 MiB chunks from / into the tier's own host buffer. Alternated and reported like (a);
    ``disk_ratio`` is the lower of the write and read ratios. Nothing is synced in either.
(c) Trace replay through the real engine (``LLMEngine``) of a Mooncake-format JSONL trace
    (``{"timestamp", "input_length", "output_length", "hash_ids"}``, one hash id per 512-token
    block). Subset: whole conversations (``traces.conversation_ids``: a request that extends an
    earlier one's full blocks is its next turn; a shared first block alone does not join two
    requests), a seeded sample of ``--root-frac`` of them or ``--requests`` requests, in trace
    order (this keeps the reuse structure). Scaling: every
    hash id becomes one block of ``block_size`` token ids drawn from ``random.Random(hash_id)``, so
    a prompt is the concatenation of its blocks (the trace's ``input_length`` is replaced by
    ``len(hash_ids) * block_size``; prompts longer than the model's context lose their last
    blocks); outputs are capped at ``--max-output``. The engine runs ``--in-flight`` requests
    at once (``max_num_seqs``). Arrivals (``--rate``): ``auto`` (the default) first replays
    device-only in a closed loop to measure the rate it sustains (requests / replay time), then
    replays every config open loop, Poisson arrivals (seeded, the same for every config) at
    ``--load`` times that rate (0.8; a comma-separated list sweeps it: a table and a plot of
    TTFT against load); a number is a fixed Poisson rate; ``closed`` is a closed loop of
    ``--in-flight`` requests (the next added when one finishes). Same order for every config.
    TTFT: arrival (closed loop: ``add_request``) to the first output carrying a token, so in the
    open loop it includes the time a request queued. Why the open loop: with a fixed number in
    flight, mean response time is that number over the throughput (Little's law), so a closed
    loop's TTFT measures throughput and how a request's time splits around its first token,
    not what queueing does to latency at a given offered load. Configs (``--configs``,
    ``scripts/tiers/replay.py``): device-only, then host + disk tiers under an eviction policy
    (LRU, hotness) and a write policy (write-through, selective, write-back); the device pool
    holds ``--device-frac`` of the subset's unique blocks (at least twice the longest request),
    the host ``--host-frac``, the disk ``--disk-frac``. Hit rate: prompt tokens found in any tier
    / prompt tokens looked up. Per config: hit rate, TTFT mean/p50/p99, replay time, bytes
    spilled per byte restored, disk bytes written per disk hit; a PNG box plot of TTFT per config.
    ``--workload hot_prompts`` replays the synthetic workload of ``scripts/tiers/workloads.py``
    (Zipf-popular system prompts, each followed by a one-off document) instead of the trace.

``--parts a,b`` runs the bandwidth parts only (their code is ``scripts/tiers/bandwidth.py``);
``--parts c`` the replay only.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from workers.default_model import resolve_model_path  # noqa: E402
from workers.model_config import ModelConfig, load_model_config  # noqa: E402

from scripts.tiers.bandwidth import run_copies, run_disk  # noqa: E402
from scripts.traces import (MOONCAKE_BLOCK_TOKENS, MOONCAKE_SYNTHETIC_TRACE, BlockTokens,  # noqa: E402
                    TraceError, TraceRequest, conversation_ids, ideal_hit_rate, read_mooncake,
                    sample_conversations)
from scripts.serve.workload import poisson_rate, poisson_times, sustained_rate  # noqa: E402
from scripts.tiers.replay import (MIN_TOKEN_ID, ReplayResult, TierSizes, engine_config,  # noqa: E402
                         fit_context, parse_config_name, replay, tier_sizes)
from scripts.tiers.report import (figures_of, plot_load_sweep, plot_ttft, print_replay,  # noqa: E402
                         print_sweep, verdict)
from scripts.tiers.workloads import WORKLOADS, hot_prompts, no_reuse  # noqa: E402

DEFAULT_TRACE = MOONCAKE_SYNTHETIC_TRACE
DEFAULT_LOAD = 0.8  # --rate auto: offered load, a fraction of device-only's sustained rate
DEFAULT_CONFIGS = ("device_only", "lru", "lru_selective", "lru_write_back", "hotness_write_back")
# Full run / --quick defaults of the size flags (None on the command line: take these).
SIZES = {
    "full": dict(copy_blocks=256, disk_blocks=512, repeats=5, root_frac=0.05, in_flight=4,
                 max_output=4),
    "quick": dict(copy_blocks=8, disk_blocks=8, repeats=2, root_frac=1.0, in_flight=2,
                  max_output=2),
}


class BenchInputError(ValueError):
    """Bad input from the command line; printed without a traceback (as is a ``TraceError``)."""


# ----- arguments -----


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="a,b,c", help="which parts to run: any of a,b,c")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL")
    p.add_argument("--workload", default="trace", choices=WORKLOADS,
                   help="(c): the --trace file, or a synthetic workload (hot_prompts, "
                        "no_reuse: scripts/tiers/workloads.py)")
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests; a minute or less)")
    p.add_argument("--copy-blocks", type=int, help="blocks per batch in (a) (256; quick 8)")
    p.add_argument("--disk-blocks", type=int, help="blocks per batch in (b) (512; quick 8)")
    p.add_argument("--repeats", type=int, help="timed rounds in (a) and (b) (5; quick 2)")
    p.add_argument("--root-frac", type=float,
                   help="fraction of the trace's conversations replayed in (c) (0.05; quick 1)")
    p.add_argument("--requests", type=int, default=None,
                   help="replay this many requests in (c) instead, whole conversations "
                        "(hot_prompts: 160, no_reuse: 120)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="(c): device_only and <lru|hotness>[_selective|_write_back] configs")
    p.add_argument("--device-frac", type=float, default=0.1,
                   help="device pool / unique blocks (at least twice the longest request)")
    p.add_argument("--host-frac", type=float, default=0.25, help="host tier / unique blocks")
    p.add_argument("--disk-frac", type=float, default=1.0, help="disk tier / unique blocks")
    p.add_argument("--write-threshold", type=int, default=1,
                   help="hits a block needs under the selective write policy")
    p.add_argument("--kv-spill-gbps", type=float, default=None,
                   help="spill bandwidth bound of every tiered config (default: none)")
    p.add_argument("--in-flight", type=int,
                   help="(c): requests the engine runs at once (max_num_seqs), and the closed "
                        "loop's requests in flight (4; quick 2)")
    p.add_argument("--rate", default="auto",
                   help="(c) arrivals: 'auto' (Poisson at --load times the rate device-only "
                        "sustains in a closed-loop calibration replay), 'closed' (closed loop, "
                        "--in-flight requests in flight), or a rate in requests/s (Poisson)")
    p.add_argument("--load", default=None,
                   help=f"--rate auto: offered load(s), fractions of the sustained rate, comma "
                        f"separated for a sweep (default {DEFAULT_LOAD})")
    p.add_argument("--max-output", type=int, help="cap on output tokens in (c) (4; quick 2)")
    p.add_argument("--disk-dir", type=Path, default=None,
                   help="where (b) and the disk tiers of (c) write, in a fresh subdirectory "
                        "removed at the end (default: a fresh directory under /tmp)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of TTFT per config (default: bench_kv_tiers_<workload>.png here)")
    p.add_argument("--seed", type=int, default=0, help="seed of the conversation sample")
    args = p.parse_args(argv)
    _check_args(p, args)
    _check_rate(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, value in SIZES["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("copy_blocks", "disk_blocks", "repeats", "in_flight", "max_output",
                 "block_size", "write_threshold"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be at least 1")
    for name in ("root_frac", "device_frac", "host_frac", "disk_frac"):
        if not 0 < getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    if args.kv_spill_gbps is not None and not args.kv_spill_gbps > 0:
        p.error("--kv-spill-gbps must be positive")
    args.parts = set(args.parts.split(","))
    if not args.parts or not args.parts <= {"a", "b", "c"}:
        p.error(f"--parts must name some of a,b,c, got {','.join(sorted(args.parts))}")
    args.configs = [c for c in args.configs.split(",") if c]
    try:
        for name in args.configs:
            parse_config_name(name)
    except ValueError as exc:
        p.error(str(exc))
    if not args.configs or len(set(args.configs)) != len(args.configs):
        p.error("--configs must name each config once")


def _check_rate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.rate``: 'auto', 'closed' or a positive float; ``args.load``: a list of positive
    loads under 'auto' (refused with the others, which would ignore it)."""
    if args.rate not in ("auto", "closed"):
        try:
            args.rate = float(args.rate)
        except ValueError:
            p.error(f"--rate must be auto, closed or requests per second, got {args.rate!r}")
        if not args.rate > 0:
            p.error(f"--rate must be positive, got {args.rate}")
    if args.load is not None and args.rate != "auto":
        p.error(f"--load applies to --rate auto only (--rate is {args.rate})")
    try:
        args.load = [float(x) for x in (args.load or str(DEFAULT_LOAD)).split(",")]
    except ValueError:
        p.error(f"--load must be comma-separated fractions, got {args.load!r}")
    if any(not x > 0 for x in args.load) or len(set(args.load)) != len(args.load):
        p.error(f"--load must be distinct positive fractions, got {args.load}")


def load_model(args: argparse.Namespace) -> ModelConfig:
    try:
        return load_model_config(resolve_model_path(args.model))
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {args.model}: {exc}") from None


def sample_rows(rows: List[TraceRequest], args: argparse.Namespace) -> List[TraceRequest]:
    if args.workload == "hot_prompts":
        return hot_prompts(args.requests or 160, seed=args.seed)
    if args.workload == "no_reuse":
        return no_reuse(args.requests or 120)
    if args.requests is not None:
        return sample_conversations(rows, args.seed, num_requests=args.requests)
    return sample_conversations(rows, args.seed, frac=args.root_frac)


def sample_desc(args: argparse.Namespace, rows: List[TraceRequest]) -> str:
    if args.workload == "hot_prompts":
        return ("hot_prompts (scripts/tiers/workloads.py: 24 prompts of 16 blocks, Zipf 1.0, "
                "each with a one-off document of 12 blocks)")
    if args.workload == "no_reuse":
        return "no_reuse (scripts/tiers/workloads.py: prompts of 32 one-off blocks)"
    what = (f"{args.requests} requests in whole conversations" if args.requests is not None
            else f"a {args.root_frac:g} sample")
    return (f"{args.trace}: {what} (seed {args.seed}) of the "
            f"{len(set(conversation_ids(rows)))} conversations")


def prepare_trace(rows: List[TraceRequest], model: ModelConfig,
                  args: argparse.Namespace) -> Tuple[List[TraceRequest], TierSizes, float]:
    subset = fit_context(sample_rows(rows, args), args.max_output, args.block_size,
                         model.max_position_embeddings)
    sizes = tier_sizes(subset, args.device_frac, args.host_frac, args.disk_frac,
                       args.block_size)
    plain, ideal = ideal_hit_rate(subset)
    num_blocks = sum(len(r.hash_ids) for r in subset)
    print(f"\n(c) replay of {sample_desc(args, rows)}: {len(subset)} requests, {num_blocks} "
          f"blocks, {sizes.unique} unique; ideal block hit rate {plain:.3f} ({ideal:.3f} "
          f"leaving each prompt's last block)")
    print(f"  scaled: 1 hash id ({MOONCAKE_BLOCK_TOKENS} tokens in the trace) -> 1 block of "
          f"{args.block_size} seeded token ids (x{args.block_size / MOONCAKE_BLOCK_TOKENS:g}); "
          f"input_length replaced by len(hash_ids) * {args.block_size}; output_length capped at "
          f"{args.max_output}; prompts cut to {model.max_position_embeddings} tokens of context")
    arrivals = (f"closed loop, {args.in_flight} requests in flight" if args.rate == "closed"
                else f"Poisson {args.rate} req/s" if args.rate != "auto"
                else f"Poisson arrivals at {','.join(f'{x:g}' for x in args.load)} of "
                     f"device-only's closed-loop rate")
    print(f"  replay: {arrivals}, the engine runs {args.in_flight} at once, same order for "
          f"every config; TTFT = arrival to the first output token; spill bound "
          f"{args.kv_spill_gbps or 'none'} GB/s; selective threshold {args.write_threshold}")
    print(f"  tiers (blocks; fraction of the {sizes.unique} unique): device {sizes.device} "
          f"({sizes.device / sizes.unique:.2f}), host {sizes.host} "
          f"({sizes.host / sizes.unique:.2f}), disk {sizes.disk} ({sizes.disk / sizes.unique:.2f})",
          flush=True)
    return subset, sizes, ideal


def run_replays(rows: List[TraceRequest], model: ModelConfig, args: argparse.Namespace,
                directory: Path) -> Dict[str, object]:
    subset, sizes, ideal = prepare_trace(rows, model, args)
    tokens = BlockTokens(args.block_size, model.vocab_size, MIN_TOKEN_ID)
    prompts = [tokens.prompt(r.hash_ids) for r in subset]
    outputs = [r.num_output_tokens for r in subset]

    def run_one(name: str, arrivals: Optional[List[float]], label: str) -> ReplayResult:
        config = engine_config(name, args.model, args.block_size, args.in_flight, sizes,
                               directory, args.write_threshold, args.kv_spill_gbps)
        try:
            result = replay(name, config, prompts, outputs, model.vocab_size, arrivals)
        finally:  # the next replay of this config starts cold (a restarted engine would load
            shutil.rmtree(directory / name, ignore_errors=True)  # the disk tier's index)
        print(f"  {label}{name:<20} {result.wall_s:7.1f} s  hit rate {result.hit_rate:.3f}  "
              f"mean TTFT {result.ttft_ms():.1f} ms  p99 {result.ttft_ms(0.99):.1f} ms  "
              f"(load average {result.load_average:.1f})", flush=True)
        return result

    figures, schedules = arrival_schedules(args, len(subset), run_one)
    sweep = []
    for load, rate, arrivals in schedules:
        label = "closed loop: " if arrivals is None else f"{rate:.2f} req/s: "
        sweep.append((load, rate, [run_one(name, arrivals, label) for name in args.configs]))
    results = sweep[0][2]
    print_replay(results, ideal)
    plot = args.plot or Path(f"bench_kv_tiers_{args.workload}.png")
    arrival = ("closed loop" if sweep[0][1] is None
               else f"Poisson {sweep[0][1]:.2f} req/s" + (f" (load {sweep[0][0]:g})"
                                                          if sweep[0][0] else ""))
    plot_ttft(results, plot, f"TTFT by tier config: {args.workload}, {len(subset)} requests, "
              f"device {sizes.device / sizes.unique:.2f} of the working set, {arrival}")
    print(f"  plot: {plot}")
    if len(sweep) > 1:
        figures["load_sweep"] = print_sweep(sweep)
        sweep_plot = plot.with_name(plot.stem + "_load" + plot.suffix)
        plot_load_sweep(sweep, sweep_plot, f"TTFT against offered load: {args.workload}, "
                        f"{len(subset)} requests, Poisson arrivals")
        figures["load_sweep_plot"] = str(sweep_plot)
        print(f"  plot: {sweep_plot}")
    figures.update({
        "workload": args.workload, "num_requests": len(subset), "num_trace_requests": len(rows),
        "num_blocks": sum(len(r.hash_ids) for r in subset), "num_unique_blocks": sizes.unique,
        "ideal_hit_rate": ideal, "root_frac": args.root_frac, "in_flight": args.in_flight,
        "device_blocks": sizes.device, "host_blocks": sizes.host, "disk_kv_blocks": sizes.disk,
        "device_frac": sizes.device / sizes.unique, "host_frac": sizes.host / sizes.unique,
        "token_scale": args.block_size / MOONCAKE_BLOCK_TOKENS, "max_output": args.max_output,
        "configs": args.configs, "plot": str(plot), "arrival": arrival,
        "arrival_rate_req_s": sweep[0][1], "load": sweep[0][0]})
    for r in results:
        figures.update(figures_of(r))
    return figures


def arrival_schedules(args: argparse.Namespace, num: int, run_one) -> Tuple[
        Dict[str, object], List[Tuple[Optional[float], Optional[float], Optional[List[float]]]]]:
    """``(load, rate, arrival times)`` per replay round: one closed-loop round (times None), one
    at a fixed rate, or one per ``--load`` after a closed-loop device-only calibration replay
    (whose sustained rate, requests / replay time, ``--rate auto`` scales). The same seeded
    Poisson times serve every config of a round."""
    if args.rate == "closed":
        return {}, [(None, None, None)]
    if args.rate != "auto":
        return {}, [(None, args.rate, poisson_times(num, args.rate, random.Random(args.seed)))]
    print("  calibration (--rate auto): device-only, closed loop", flush=True)
    calibration = run_one("device_only", None, "calibration: ")
    sustained = sustained_rate(num, calibration.wall_s)
    rates = [poisson_rate(sustained, load) for load in args.load]
    print(f"  sustained {sustained:.2f} req/s; offered: "
          + ", ".join(f"{load:g} x = {rate:.2f} req/s" for load, rate in zip(args.load, rates)),
          flush=True)
    figures = {"sustained_req_s_device_only": sustained,
               "closed_loop_ttft_ms_device_only": calibration.ttft_ms(),
               "closed_loop_ttft_p99_ms_device_only": calibration.ttft_ms(0.99)}
    return figures, [(load, rate, poisson_times(num, rate, random.Random(args.seed)))
                     for load, rate in zip(args.load, rates)]


def run(args: argparse.Namespace) -> Dict[str, object]:
    started, load_start = time.perf_counter(), os.getloadavg()
    # Bad trace files fail before anything is measured.
    rows = read_mooncake(args.trace) if "c" in args.parts and args.workload == "trace" else []
    model = load_model(args)
    print(f"machine: {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load average "
          f"{load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at start; KV of "
          f"{args.model} at TP 1: {model.num_layers} layers, {model.num_kv_heads} KV heads, "
          f"head_dim {model.head_dim}, block {args.block_size}, fp32", flush=True)
    if args.disk_dir is not None:
        args.disk_dir.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench_kv_tiers_",
                                      dir=args.disk_dir if args.disk_dir else "/tmp"))
    figures: Dict[str, object] = {}
    try:
        if "a" in args.parts:
            figures.update(run_copies(model, args))
        if "b" in args.parts:
            figures.update(run_disk(model, args, directory))
        if "c" in args.parts:
            figures.update(run_replays(rows, model, args, directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    figures.update(verdict(figures))
    load_end = os.getloadavg()
    wall_s = time.perf_counter() - started
    print(f"\nload average {load_end[0]:.2f} at the end; {wall_s:.0f} s in all")
    return {"model": resolve_model_path(args.model).name, "block_size": args.block_size,
            "quick": args.quick, **figures, "load_average_start": load_start[0],
            "load_average_end": load_end[0], "torch_threads": torch.get_num_threads(),
            "bench_wall_s": wall_s}


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
