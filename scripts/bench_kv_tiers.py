"""Benchmark the KV tiers below the device pool: copy and disk bandwidth, prefix hits on a trace.

Three parts, in one process, one after another:

(a) Host copies. One rank's tier machinery (``KVCache``, ``HostBuffer``, ``TransferEngine``) with
    the KV shape of ``--model`` at TP 1 moves ``--copy-blocks`` blocks per batch: one ``submit`` of
    that many ``Spill`` ops (device -> host, each block's xxh3 checksum computed), wait; then as
    many ``Restore`` ops (host -> device, each block checked against its checksum). The baseline
    is a plain ``dst.copy_(src)`` of contiguous float32 tensors of exactly the same total bytes.
    Tier and baseline alternate (which runs first alternates too), ``--repeats`` times after one
    warm-up round; medians are reported. ``host_copy_ratio`` is the lower of the two directions'
    ratios (tier GB/s / plain GB/s).
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
    blocks); outputs are capped at ``--max-output``. Replay: closed loop, ``--in-flight``
    requests at a time (the next is added when one finishes), same order for every config.
    TTFT: ``add_request`` to the first output carrying a token. Configs: device-only, then host +
    disk tiers with LRU, then with hotness eviction; the device pool holds ``--device-frac`` of the
    subset's unique blocks (at least twice the longest request), the host ``--host-frac``, the
    disk every unique block. Hit rate: prompt tokens found in any tier / prompt tokens looked up.

``--parts a,b`` runs the bandwidth parts only (their code is ``scripts/tier_bandwidth.py``).
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):  # run from anywhere, or imported by path (tests)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from workers.config import EngineConfig  # noqa: E402
from workers.default_model import resolve_model_path  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.model_config import ModelConfig, load_model_config  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

from tier_bandwidth import (TARGET_COPY_RATIO, TARGET_DISK_RATIO, bandwidth_verdict,  # noqa: E402
                            run_copies, run_disk)
from traces import (MOONCAKE_BLOCK_TOKENS, MOONCAKE_SYNTHETIC_TRACE, BlockTokens,  # noqa: E402
                    TraceError, TraceRequest, conversation_ids, ideal_hit_rate, read_mooncake,
                    sample_conversations)

DEFAULT_TRACE = MOONCAKE_SYNTHETIC_TRACE
MIN_TOKEN_ID = 3  # stay clear of the special tokens at the lowest ids
TARGET_SPILL_GAIN = 1.5
CONFIGS = ("device_only", "lru", "hotness")
PARTS = ("a", "b", "c")
# Full run / --quick defaults of the size flags (None on the command line: take these).
SIZES = {
    "full": dict(copy_blocks=256, disk_blocks=512, repeats=5, root_frac=0.05, in_flight=4,
                 max_output=4),
    "quick": dict(copy_blocks=8, disk_blocks=8, repeats=2, root_frac=1.0, in_flight=2,
                  max_output=2),
}


class BenchInputError(ValueError):
    """Bad input from the command line; printed without a traceback (as is a ``TraceError``)."""


# ----- (c): the trace -----


def fit_context(rows: Sequence[TraceRequest], max_output: int, block_size: int,
                max_model_len: int) -> List[TraceRequest]:
    """Outputs capped at ``max_output``; prompts cut to whole blocks that fit the context."""
    fitted = []
    for r in rows:
        output = min(r.num_output_tokens, max_output, max_model_len - 1)
        max_blocks = max(1, (max_model_len - output) // block_size)
        fitted.append(replace(r, hash_ids=r.hash_ids[:max_blocks], num_output_tokens=output))
    return fitted


@dataclass(frozen=True)
class TierSizes:
    device: int
    host: int
    disk: int
    unique: int


def tier_sizes(rows: Sequence[TraceRequest], args: argparse.Namespace) -> TierSizes:
    unique = len({r.hash_ids[:i + 1] for r in rows for i in range(len(r.hash_ids))})
    longest = max(len(r.hash_ids) + -(-r.num_output_tokens // args.block_size) for r in rows)
    device = max(round(args.device_frac * unique), 2 * longest)
    return TierSizes(device, max(1, round(args.host_frac * unique)), unique, unique)


# ----- (c): the replay -----


@dataclass
class ReplayResult:
    name: str
    wall_s: float
    ttft_s: List[float]
    hit_rate: float
    num_preemptions: int
    tier_stats: Dict[str, object]
    load_average: float = 0.0  # 1-minute load average right after the run

    def ttft_ms(self, q: Optional[float] = None) -> float:
        if q is None:
            return 1e3 * statistics.fmean(self.ttft_s)
        ordered = sorted(self.ttft_s)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine_config(name: str, args: argparse.Namespace, sizes: TierSizes,
                  disk_root: Path) -> EngineConfig:
    common = dict(model=args.model, block_size=args.block_size, num_kv_blocks=sizes.device,
                  max_num_seqs=args.in_flight, device="cpu")
    if name == "device_only":
        return EngineConfig(**common)
    return EngineConfig(**common, host_kv_blocks=sizes.host, disk_kv_dir=str(disk_root / name),
                        disk_kv_blocks=sizes.disk, kv_eviction=name)


def replay(name: str, config: EngineConfig, prompts: Sequence[List[int]],
           outputs: Sequence[int], vocab_size: int) -> ReplayResult:
    """Closed loop: ``max_num_seqs`` requests in flight; TTFT per request, hit rate of the run."""
    with LLMEngine(config) as engine:
        warm = random.Random("warm-up")  # tokens no trace block has, so nothing hits on them
        _drain(engine, [warm.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(40)], 2)
        kv = engine.scheduler.kv
        queries, hits = kv.num_prefix_queries, kv.num_prefix_hits
        preemptions = engine.scheduler.num_preemptions
        added: Dict[str, float] = {}
        ttft: Dict[str, float] = {}
        pending = list(range(len(prompts)))[::-1]
        num_running = 0
        started = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and num_running < config.max_num_seqs:
                i = pending.pop()
                added[str(i)] = time.perf_counter()
                engine.add_request(prompts[i], _params(outputs[i]), request_id=str(i))
                num_running += 1
            for out in engine.step():
                if out.new_token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - added[out.request_id]
                num_running -= out.finished
        wall_s = time.perf_counter() - started
        num_queries = kv.num_prefix_queries - queries
        return ReplayResult(name, wall_s, list(ttft.values()),
                            (kv.num_prefix_hits - hits) / num_queries if num_queries else 0.0,
                            engine.scheduler.num_preemptions - preemptions,
                            engine.kv_tier_stats())


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drain(engine: LLMEngine, prompt: List[int], max_tokens: int) -> None:
    engine.add_request(prompt, _params(max_tokens), request_id="warm-up")
    while engine.has_unfinished():
        engine.step()


# ----- reporting -----


def print_replay(results: Sequence[ReplayResult], ideal: float) -> None:
    print(f"\n  {'config':<13}{'hit rate':>9}{'TTFT ms mean':>14}{'p50':>8}{'p99':>8}"
          f"{'wall s':>8}{'preempt':>8}{'load':>6}")
    for r in results:
        print(f"  {r.name:<13}{r.hit_rate:>9.3f}{r.ttft_ms():>14.1f}{r.ttft_ms(0.5):>8.1f}"
              f"{r.ttft_ms(0.99):>8.1f}{r.wall_s:>8.1f}{r.num_preemptions:>8}"
              f"{r.load_average:>6.1f}")
    print(f"  ideal (infinite cache, last block computed as the engine does): {ideal:.3f}")
    for r in results:
        s = r.tier_stats
        if "kv_tier_host_hits_total" in s:
            print(f"  {r.name}: host hits {s['kv_tier_host_hits_total']} blocks, disk hits "
                  f"{s.get('kv_tier_disk_hits_total', 0)}, spilled "
                  f"{s['kv_tier_spilled_bytes_total'] / 2**20:.1f} MiB, restored "
                  f"{s['kv_tier_restored_bytes_total'] / 2**20:.1f} MiB, disk written "
                  f"{s['kv_tier_disk_written_bytes_total'] / 2**20:.1f} MiB, read "
                  f"{s['kv_tier_disk_read_bytes_total'] / 2**20:.1f} MiB, checksum failures "
                  f"{s['kv_tier_checksum_failures_total']}, I/O errors "
                  f"{s['kv_tier_io_errors_total']}")


def tier_extras(r: ReplayResult) -> Dict[str, object]:
    keys = ("host_hits_total", "disk_hits_total", "spilled_bytes_total", "restored_bytes_total",
            "disk_written_bytes_total", "disk_read_bytes_total", "checksum_failures_total",
            "io_errors_total")
    return {f"{r.name}_{k}": r.tier_stats.get(f"kv_tier_{k}") for k in keys}


# ----- main -----


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL")
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests; a minute or less)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="which parts to run, comma-separated (a,b,c; e.g. a,b for bandwidth only)")
    p.add_argument("--copy-blocks", type=int, help="blocks per batch in (a) (256; quick 8)")
    p.add_argument("--disk-blocks", type=int, help="blocks per batch in (b) (512; quick 8)")
    p.add_argument("--repeats", type=int, help="timed rounds in (a) and (b) (5; quick 2)")
    p.add_argument("--root-frac", type=float,
                   help="fraction of the trace's conversations replayed in (c) (0.05; quick 1)")
    p.add_argument("--requests", type=int, default=None,
                   help="replay this many requests in (c) instead, whole conversations")
    p.add_argument("--device-frac", type=float, default=0.1,
                   help="device pool / unique blocks (at least twice the longest request)")
    p.add_argument("--host-frac", type=float, default=0.25, help="host tier / unique blocks")
    p.add_argument("--in-flight", type=int, help="requests in flight in (c) (4; quick 2)")
    p.add_argument("--max-output", type=int, help="cap on output tokens in (c) (4; quick 2)")
    p.add_argument("--disk-dir", type=Path, default=None,
                   help="where (b) and the disk tiers of (c) write, in a fresh subdirectory "
                        "removed at the end (default: a fresh directory under /tmp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the conversation sample")
    args = p.parse_args(argv)
    args.parts = tuple(part.strip() for part in args.parts.split(",") if part.strip())
    if not args.parts or not set(args.parts) <= set(PARTS):
        p.error(f"--parts {','.join(args.parts)}: expected a comma-separated subset of "
                f"{','.join(PARTS)}")
    for name, value in SIZES["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("copy_blocks", "disk_blocks", "repeats", "in_flight", "max_output",
                 "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be at least 1")
    for name in ("root_frac", "device_frac", "host_frac"):
        if not 0 < getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    return args


def load_model(args: argparse.Namespace) -> ModelConfig:
    try:
        return load_model_config(resolve_model_path(args.model))
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {args.model}: {exc}") from None


def sample_trace(rows: List[TraceRequest], args: argparse.Namespace) -> List[TraceRequest]:
    if args.requests is not None:
        return sample_conversations(rows, args.seed, num_requests=args.requests)
    return sample_conversations(rows, args.seed, frac=args.root_frac)


def sample_desc(args: argparse.Namespace) -> str:
    if args.requests is not None:
        return f"{args.requests} requests in whole conversations"
    return f"a {args.root_frac:g} sample"


def prepare_trace(rows: List[TraceRequest], model: ModelConfig,
                  args: argparse.Namespace) -> Tuple[List[TraceRequest], TierSizes, float]:
    subset = fit_context(sample_trace(rows, args), args.max_output, args.block_size,
                         model.max_position_embeddings)
    sizes = tier_sizes(subset, args)
    plain, ideal = ideal_hit_rate(subset)
    num_blocks = sum(len(r.hash_ids) for r in subset)
    print(f"\n(c) trace replay: {args.trace}")
    print(f"  subset: {sample_desc(args)} (seed {args.seed}) of the "
          f"{len(set(conversation_ids(rows)))} conversations: {len(subset)} of {len(rows)} "
          f"requests, {num_blocks} blocks, {sizes.unique} unique; "
          f"ideal block hit rate {plain:.3f} ({ideal:.3f} leaving each prompt's last block)")
    print(f"  scaled: 1 hash id ({MOONCAKE_BLOCK_TOKENS} tokens in the trace) -> 1 block of "
          f"{args.block_size} seeded token ids (x{args.block_size / MOONCAKE_BLOCK_TOKENS:g}); "
          f"input_length replaced by len(hash_ids) * {args.block_size}; output_length capped at "
          f"{args.max_output}; prompts cut to {model.max_position_embeddings} tokens of context")
    print(f"  replay: closed loop, {args.in_flight} requests in flight, trace order, same for "
          f"every config; TTFT = add_request to the first output token")
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
    results = []
    for name in CONFIGS:
        config = engine_config(name, args, sizes, directory)
        result = replay(name, config, prompts, outputs, model.vocab_size)
        result.load_average = os.getloadavg()[0]
        print(f"  {name:<12} {result.wall_s:7.1f} s  hit rate {result.hit_rate:.3f}  mean TTFT "
              f"{result.ttft_ms():.1f} ms  (load average {result.load_average:.1f})", flush=True)
        results.append(result)
    print_replay(results, ideal)
    figures: Dict[str, object] = {
        "num_requests": len(subset), "num_trace_requests": len(rows),
        "num_blocks": sum(len(r.hash_ids) for r in subset), "num_unique_blocks": sizes.unique,
        "ideal_hit_rate": ideal, "root_frac": args.root_frac, "in_flight": args.in_flight,
        "device_blocks": sizes.device, "host_blocks": sizes.host, "disk_kv_blocks": sizes.disk,
        "device_frac": sizes.device / sizes.unique, "host_frac": sizes.host / sizes.unique,
        "token_scale": args.block_size / MOONCAKE_BLOCK_TOKENS, "max_output": args.max_output}
    for r in results:
        figures.update({f"hit_rate_{r.name}": r.hit_rate, f"ttft_ms_{r.name}": r.ttft_ms(),
                        f"ttft_p50_ms_{r.name}": r.ttft_ms(0.5),
                        f"ttft_p99_ms_{r.name}": r.ttft_ms(0.99),
                        f"replay_wall_s_{r.name}": r.wall_s,
                        f"preemptions_{r.name}": r.num_preemptions})
        if r.name != "device_only":
            figures.update(tier_extras(r))
    return figures


def verdict(figures: Dict[str, object]) -> Dict[str, object]:
    """The issue's targets, met or not, printed and returned."""
    base = figures["hit_rate_device_only"]
    gains = {name: figures[f"hit_rate_{name}"] / base if base else None
             for name in ("lru", "hotness")}  # None: device-only never hit
    winner = "hotness" if figures["ttft_ms_hotness"] < figures["ttft_ms_lru"] else "lru"
    hit_winner = ("tie" if figures["hit_rate_hotness"] == figures["hit_rate_lru"] else
                  "hotness" if figures["hit_rate_hotness"] > figures["hit_rate_lru"] else "lru")
    met = {"host_copy_ratio_ge_0.8": figures["host_copy_ratio"] >= TARGET_COPY_RATIO,
           "disk_ratio_ge_0.8": figures["disk_ratio"] >= TARGET_DISK_RATIO,
           **{f"spill_hit_gain_{name}_ge_1.5": (figures[f"hit_rate_{name}"] > 0 if gain is None
                                                 else gain >= TARGET_SPILL_GAIN)
              for name, gain in gains.items()}}
    print("\ntargets:")
    print(f"  tier copies >= {TARGET_COPY_RATIO:.0%} of plain copy_: "
          f"{figures['host_copy_ratio']:.2f} -> {_met(met['host_copy_ratio_ge_0.8'])}")
    print(f"  disk >= {TARGET_DISK_RATIO:.0%} of raw O_DIRECT: {figures['disk_ratio']:.2f} -> "
          f"{_met(met['disk_ratio_ge_0.8'])}")
    for name, gain in gains.items():
        shown = "device-only 0" if gain is None else f"{gain:.2f}x"
        print(f"  hit rate with spill ({name}) >= {TARGET_SPILL_GAIN}x device-only: {shown} "
              f"-> {_met(met[f'spill_hit_gain_{name}_ge_1.5'])}")
    print(f"  hotness vs LRU: hit rate {figures['hit_rate_hotness']:.3f} vs "
          f"{figures['hit_rate_lru']:.3f}, mean TTFT {figures['ttft_ms_hotness']:.1f} vs "
          f"{figures['ttft_ms_lru']:.1f} ms: {hit_winner} on hit rate, {winner} on TTFT")
    return {"spill_hit_gain_lru": gains["lru"], "spill_hit_gain_hotness": gains["hotness"],
            "hit_rate_winner": hit_winner, "ttft_winner": winner, "targets_met": met}


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def run(args: argparse.Namespace) -> Dict[str, object]:
    started, load_start = time.perf_counter(), os.getloadavg()
    # Bad trace files fail before anything is measured.
    rows = read_mooncake(args.trace) if "c" in args.parts else []
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
    figures.update(verdict(figures) if set(args.parts) == set(PARTS)
                   else bandwidth_verdict(figures))
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
