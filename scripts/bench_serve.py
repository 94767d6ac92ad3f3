"""Benchmark the serving stack on a workload where KV capacity and shared prefixes decide tail
latency: tpserve's KV-aware router against Serve's power-of-two-choices, Serve's
``PrefixCacheAffinityRouter`` and round robin, same requests, same load, same run.

One local Ray; for each router in turn a fresh Serve application (``cluster.app.build_app``: the
OpenAI ingress in front of ``--groups`` TP groups of ``--tp`` ranks), a short warm-up, then the
same requests at the same arrival times, sent with the official ``openai`` client
(``AsyncOpenAI``, streaming ``/v1/completions``, token-id prompts, greedy, ``ignore_eos`` so every
request generates exactly its ``max_tokens``). The runs differ only in the group deployment's
``request_router_config`` (``cluster.app.router_config``; the baselines are in
``cluster/routing/baseline_routers.py``), with the same routing-stats period.

The workload (``serve_workload.py``), from a trace (``--trace``, format detected from the
content; ``traces.py`` reads both):

* Mooncake JSONL (the default, ``mooncake_synthetic_trace.jsonl``): one hash id per 512-token
  block; each becomes ``512 / --prompt-scale`` token ids seeded by the id, so requests that share
  hash ids share real prompt prefixes. ``--system-prompt-blocks`` shared blocks go in front of
  every prompt (a system prompt, as agent and chat traces have). ``--requests`` requests are
  sampled as whole conversations (``traces.sample_conversations``: a request that extends an
  earlier one's full blocks is its next turn), in trace order; ``--min-turns N`` (3) samples only
  conversations of at least N turns (multi-turn chat, where each turn resends the history: with
  1, most of the synthetic trace's 2,758 conversations are single requests, and the routers'
  hit rates differ by the shared system prompt alone).
* Azure LLM inference CSV: no token contents, every prompt is seeded random token ids.

KV pressure: ``--kv-blocks auto`` (the default) sizes each group's pool so that the working set
(every distinct full prompt block once, plus each request's own partial and output blocks) is
``--kv-pressure`` (3.0) times one group's pool: two groups together hold two thirds of it if
each keeps its own prefixes, a third if both must hold all of them. ``--host-kv-blocks N`` gives
each group a host tier of N blocks below its pool (none by default). Near saturation:
``--rate auto`` (the default) first runs a sample of the requests (``--calibration-requests``)
all at once through a separate deployment (power of two choices), takes requests done / time as
what the groups sustain, and sets the Poisson rate to ``--load`` (0.9) of it; both are printed.
``--target`` with several values (``0.5,0.6,0.7,0.8,0.9``) sweeps the occupancy target of each
KV-aware router in ``--routers`` on the same requests, runs the others once, and plots TTFT p99
and throughput against the target, the others as flat lines (``--plot-out``). ``--repeat N``
replays every router N times, the arrivals reseeded and the order rotated each round, and
reports the rounds pooled and one by one (``serve_rounds.py``: one 200-request run's TTFT p99 is
its second-slowest request), and the KV-aware router against each other router paired by round
(the mean of the per-round ratio or difference and its 95% t-interval).

Per router: throughput (output tokens of successful requests over first send to last response),
TTFT p50/p99, ITL p99, preemptions, prefix-cache hit rate and each group's peak and mean KV
usage (the groups' own metrics, read from the ingress's ``/metrics`` every second), the load
average at the start and end of the run and the CPU share other processes took. Requests that
fail, end short or are cut at the run's deadline are counted as failures by kind; arrivals past
``--max-duration-s`` are counted as not sent.

Router decision time: the KV-aware router records the time of each placement decision
(``KVAwareRouter.decision_times_us``), read from the ingress replica after its run: the live
figure, with ``--groups`` groups. The pure policy ``cluster.routing.ranking.rank_groups`` is also timed
here on synthetic loads of 2 and 64 groups (the target: under 50 us with 64 groups).

The last line printed is one JSON object with every figure (the KV-aware router's unsuffixed,
at the first ``--target``; the others' with ``_pow2``, ``_prefix_affinity``, ``_round_robin``;
a sweep's as lists ``<figure>_by_target``; with ``--repeat`` the pooled figures, and each
round's as lists ``<figure>_by_round``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

from scripts.serve.host_load import cpu_snapshot, load_average, other_cpu_frac  # noqa: E402,F401
from scripts.serve.cluster import Endpoint, local_serve, run_router  # noqa: E402
from scripts.serve.replay import (RequestResult, RunResult, log,  # noqa: E402,F401
                          parse_group_metrics)
from scripts.serve.rounds import (paired, plot_ttft, pool_runs, print_paired,  # noqa: E402,F401
                          print_rounds, round_orders, rounds_json)
from scripts.serve.report import (finish_sweep, flat_json, host_tier, json_suffix,  # noqa: E402,F401
                          percentile, plot_sweep, print_header, print_router_lines, print_table,
                          router_figures, run_label, summarize, sweep_json, target_checks,
                          time_rank_groups)
from scripts.serve.workload import (BenchRequest, Scaling, arrival_times,  # noqa: E402,F401
                            auto_kv_blocks, build_workload, calibration_sample, ideal_hit_rate,
                            longest_request_blocks, poisson_rate, sustained_rate, with_rate,
                            with_system_prompt, working_set_blocks, workload_figures)
from scripts.traces import (MOONCAKE_SYNTHETIC_TRACE, TraceError, TraceRequest,  # noqa: E402,F401
                    conversation_ids, read_trace, sample_conversations)

DEFAULT_TRACE = MOONCAKE_SYNTHETIC_TRACE
ROUTERS = ("kv", "pow2", "prefix_affinity", "round_robin")
SWEPT_ROUTERS = ("kv",)  # the routers that take the occupancy target
DEFAULT_PLOT = "/tmp/tpserve_bench_serve_sweep.png"
DEFAULT_ROUNDS_PLOT = "/tmp/tpserve_bench_serve_ttft.png"


# ----- arguments -----


DEFAULT_MIN_TURNS = 3  # Mooncake traces: multi-turn conversations (the module doc)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="Mooncake JSONL or Azure CSV trace (default: %(default)s)")
    p.add_argument("--requests", "--num-requests", dest="num_requests", type=int, default=80,
                   help="requests replayed, sampled as whole conversations")
    p.add_argument("--min-turns", type=int, default=None,
                   help="sample only conversations of at least this many turns (multi-turn "
                        "chat, each turn resending the history); 1: every conversation "
                        "(default: 3 for a Mooncake trace, 1 for Azure, which has no turns)")
    p.add_argument("--system-prompt-blocks", type=int, default=8,
                   help="shared hash blocks (512 trace tokens each) in front of every prompt")
    p.add_argument("--arrival", choices=("poisson", "trace"), default="poisson")
    p.add_argument("--rate", default="auto",
                   help="Poisson arrivals per second, or 'auto': --load x what the groups "
                        "sustain, measured first")
    p.add_argument("--load", type=float, default=0.9, help="--rate auto: fraction of sustained")
    p.add_argument("--calibration-requests", type=int, default=None,
                   help="--rate auto: requests sent all at once to measure (N/4, at least 8)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="--arrival trace: the trace's times are divided by this")
    p.add_argument("--prompt-scale", type=int, default=64)
    p.add_argument("--max-output", type=int, default=16)
    p.add_argument("--model", default="default", help="'default' or a checkpoint directory")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ingress-replicas", default="1",
                   help="ingress replicas, N or MIN:MAX (default 1: the routers are compared in "
                        "one ingress, as in the published figures; tpserve serve's default is 2:4)")
    p.add_argument("--kv-blocks", default="auto",
                   help="KV pool blocks per group, or 'auto': working set / --kv-pressure")
    p.add_argument("--kv-pressure", type=float, default=3.0,
                   help="--kv-blocks auto: working set / one group's pool")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--host-kv-blocks", type=int, default=0,
                   help="each group's host KV tier, in blocks (0: none): blocks the pool "
                        "evicts are copied back from there instead of recomputed")
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help=f"comma-separated, of {', '.join(ROUTERS)}")
    p.add_argument("--target", default="0.7",
                   help="the KV-aware router's occupancy target; several (0.5,0.6,...): a "
                        "sweep of each KV-aware router named, the others run once")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds: each router replays the requests this many times, arrivals "
                        "reseeded and the order rotated each round; figures pooled")
    p.add_argument("--plot-out", default=None,
                   help=f"the sweep's PNG ({DEFAULT_PLOT}), or with --repeat the pooled TTFT "
                        f"distributions' ({DEFAULT_ROUNDS_PLOT})")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1)
    p.add_argument("--max-duration-s", type=float, default=240.0,
                   help="per run: arrivals after this are not sent (and counted)")
    p.add_argument("--drain-timeout-s", type=float, default=150.0,
                   help="per run: wait this long after the last send, then cancel the rest")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    return check_args(p, p.parse_args(argv))


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if min(args.num_requests, args.prompt_scale, args.max_output,
           1 if args.min_turns is None else args.min_turns) < 1:
        p.error("--requests, --prompt-scale, --max-output and --min-turns must be at least 1")
    args.rate = _auto_or(p, "--rate", args.rate, float)
    args.kv_blocks = _auto_or(p, "--kv-blocks", args.kv_blocks, int)
    if (args.rate is not None and args.rate <= 0) or args.time_scale <= 0 or args.load <= 0:
        p.error("--rate, --time-scale and --load must be positive")
    if (args.groups < 1 or args.system_prompt_blocks < 0 or args.kv_pressure <= 0
            or args.host_kv_blocks < 0):
        p.error("--groups must be at least 1, --system-prompt-blocks and --host-kv-blocks at "
                "least 0, --kv-pressure positive")
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if not args.routers or set(args.routers) - set(ROUTERS):
        p.error(f"--routers takes a comma-separated list of "
                f"{', '.join(ROUTERS)}")
    try:
        args.targets = [float(t) for t in args.target.split(",")]
    except ValueError:
        p.error(f"--target takes numbers in (0, 1], comma-separated, got {args.target!r}")
    if not all(0 < t <= 1 for t in args.targets):
        p.error(f"--target takes numbers in (0, 1], got {args.target!r}")
    if len(args.targets) > 1 and not set(args.routers) & set(SWEPT_ROUTERS):
        p.error(f"--target with several values sweeps a KV-aware router; --routers names none "
                f"of {', '.join(SWEPT_ROUTERS)}")
    if args.repeat < 1 or (args.repeat > 1 and len(args.targets) > 1):
        p.error(f"--repeat takes a count of at least 1, and one --target value (rounds of a "
                f"sweep are not supported), got --repeat {args.repeat} --target {args.target}")
    if args.plot_out is None:
        args.plot_out = DEFAULT_ROUNDS_PLOT if args.repeat > 1 else DEFAULT_PLOT
    if args.calibration_requests is None:
        args.calibration_requests = max(8, args.num_requests // 4)
    return args


def _auto_or(p: argparse.ArgumentParser, flag: str, value: str, kind: type) -> Any:
    if value == "auto":
        return None
    try:
        return kind(value)
    except ValueError:
        p.error(f"{flag} takes 'auto' or a number, got {value!r}")


# ----- the workload and its sizes -----


@dataclasses.dataclass
class Workload:
    requests: List[BenchRequest]
    meta: Dict[str, Any]
    vocab_size: int
    model_dir: Path
    rate_req_s: Optional[float] = None  # Poisson arrivals (None: the trace's times)


def prepare(args: argparse.Namespace) -> Workload:
    """Sampled, scaled requests (arrivals at rate 1/s until --rate auto sets it), the pool."""
    trace_format, rows = read_trace(args.trace)
    rows = with_system_prompt(rows, args.system_prompt_blocks if trace_format == "mooncake" else 0)
    if args.min_turns is None:
        args.min_turns = DEFAULT_MIN_TURNS if trace_format == "mooncake" else 1
    rows = sample_conversations(rows, args.seed, num_requests=args.num_requests,
                                min_turns=args.min_turns)

    from workers.default_model import resolve_model_path
    from workers.model_config import load_model_config

    model_dir = resolve_model_path(args.model)
    model = load_model_config(model_dir)
    scaling = Scaling(args.prompt_scale, args.max_output, args.arrival, args.rate or 1.0,
                      args.time_scale)
    requests = build_workload(rows, scaling, model.vocab_size, model.max_position_embeddings,
                              args.seed)
    figures = workload_figures(requests, args.block_size)
    kv_blocks, why = (args.kv_blocks, "--kv-blocks") if args.kv_blocks else auto_kv_blocks(
        figures["working_set_blocks"], figures["longest_request_blocks"], args.kv_pressure)
    meta = {
        "trace": str(args.trace), "trace_format": trace_format, "seed": args.seed,
        "num_requests": len(requests), "num_conversations": len(set(conversation_ids(rows))),
        "min_turns": args.min_turns,
        "system_prompt_blocks": args.system_prompt_blocks if trace_format == "mooncake" else 0,
        "model": model_dir.name, "dtype": "float32 on CPU" if engine_is_cpu() else
        "checkpoint dtype on CUDA", "tp": args.tp, "groups": args.groups,
        "kv_blocks": kv_blocks, "kv_blocks_why": why, "block_size": args.block_size,
        "host_kv_blocks": args.host_kv_blocks,
        "working_set_over_pool": round(figures["working_set_blocks"] / kv_blocks, 2),
        "prompt_scale": args.prompt_scale, "max_output": args.max_output,
        "arrival": args.arrival, "load": args.load if args.rate is None else None, **figures,
    }
    return Workload(requests, meta, model.vocab_size, model_dir)


def serve_config(args: argparse.Namespace, work: Workload, target: float) -> Any:
    from cluster.app import ServeConfig
    from workers.config import EngineConfig

    engine = EngineConfig(model=str(work.model_dir), tp_size=args.tp, block_size=args.block_size,
                          num_kv_blocks=work.meta["kv_blocks"], seed=args.seed,
                          host_kv_blocks=args.host_kv_blocks or None)
    return ServeConfig(engine=engine, min_groups=args.groups, max_groups=args.groups,
                       served_model_name=work.model_dir.name, kv_target_occupancy=target,
                       ingress_replicas=args.ingress_replicas)


def set_arrivals(args: argparse.Namespace, work: Workload, endpoint: Endpoint) -> None:
    """Poisson arrivals at --rate, or at --load x the rate measured on a sample (--rate auto)."""
    meta = work.meta
    if args.arrival == "trace":
        meta.update(rate_req_s=None, sustained_req_s=None)
        meta["arrival_desc"] = f"trace times / {args.time_scale}"
    else:
        rate = args.rate or poisson_rate(calibrate(args, work, endpoint), args.load)
        work.requests = with_rate(work.requests, rate, args.seed)
        work.rate_req_s = rate
        meta["rate_req_s"] = round(rate, 3)
        meta["arrival_desc"] = f"Poisson {rate:.3f} req/s"
        if args.rate is None:
            log(f"--rate auto: sustained {meta['sustained_req_s']} req/s; Poisson rate "
                f"{args.load} x that = {rate:.3f} req/s")
    meta["arrival_desc"] += f", last at {work.requests[-1].arrival_s:.1f} s"


def calibrate(args: argparse.Namespace, work: Workload, endpoint: Endpoint) -> float:
    """Requests per second the groups finish: a sample sent all at once to a fresh deployment
    (power of two choices, so no prefix placement flatters it)."""
    sample = calibration_sample(work.requests, args.calibration_requests)
    run = run_router("pow2", serve_config(args, work, args.targets[0]), endpoint, sample,
                     label="calibration")
    summary = summarize(run)
    if summary["num_ok"] < len(sample):
        raise RuntimeError(f"--rate auto: {summary['num_failed']} of {len(sample)} "
                           f"calibration requests failed ({summary['failures']})")
    sustained = sustained_rate(summary["num_ok"], summary["duration_s"])
    work.meta.update(sustained_req_s=round(sustained, 3), calibration_requests=len(sample),
                     calibration_s=summary["duration_s"],
                     calibration_load_avg=summary["load_avg"])
    return sustained


# ----- main -----


RunKey = Tuple[str, Optional[float]]  # (router, its --target in a sweep; None: not swept)


def run_routers(args: argparse.Namespace, work: Workload, endpoint: Endpoint,
                order: Optional[Sequence[str]] = None,
                requests: Optional[List[BenchRequest]] = None,
                round_tag: str = "") -> Dict[RunKey, RunResult]:
    """Each router of --routers (in ``order``), one after another, on the same requests; with
    several --target values, each KV-aware one at every target (the sweep) and the others once
    (its baselines)."""
    sweep = len(args.targets) > 1
    runs: Dict[RunKey, RunResult] = {}
    for router in order or args.routers:
        for target in (args.targets if sweep and router in SWEPT_ROUTERS else [None]):
            config = serve_config(args, work, args.targets[0] if target is None else target)
            runs[(router, target)] = run_router(router, config, endpoint,
                                                requests or work.requests,
                                                label=run_label(router, target) + round_tag)
    return {key: runs[key] for key in sorted(runs, key=lambda k: args.routers.index(k[0]))}


def run_rounds(args: argparse.Namespace, work: Workload,
               endpoint: Endpoint) -> List[Dict[RunKey, RunResult]]:
    """--repeat: every router once a round; round i's order is --routers rotated by i and its
    Poisson arrivals are seeded --seed + i (round 0's are the single run's)."""
    rounds = []
    for i, order in enumerate(round_orders(args.routers, args.repeat)):
        requests = work.requests
        if i and work.rate_req_s is not None:
            requests = with_rate(work.requests, work.rate_req_s, args.seed + i)
        rounds.append(run_routers(args, work, endpoint, order, requests,
                                  round_tag=f", round {i + 1}/{args.repeat}"))
    return rounds


def main(argv: Optional[Sequence[str]] = None) -> int:
    wall_start = time.perf_counter()
    args = parse_args(argv)
    work = prepare(args)
    rank_us = {n: time_rank_groups(n) for n in (2, 64)}
    with local_serve(args.num_cpus) as port:
        endpoint = Endpoint(port, work.model_dir.name, work.vocab_size, 2 * args.groups,
                            args.max_duration_s, args.drain_timeout_s, args.request_timeout_s)
        set_arrivals(args, work, endpoint)
        rounds = run_rounds(args, work, endpoint) if args.repeat > 1 else []
        runs = ({key: pool_runs([r[key] for r in rounds]) for key in rounds[0]} if rounds
                else run_routers(args, work, endpoint))
    summary = {key: summarize(run) for key, run in runs.items()}
    first = args.targets[0]
    kv_run = runs.get(("kv", None)) or runs.get(("kv", first))
    meta = {**work.meta, "router": router_figures(kv_run and kv_run.router_stats, rank_us)}
    sys.stderr.flush()
    print_header(meta)
    print_table({run_label(*key): s for key, s in summary.items()})
    # The unsuffixed figures and the targets: the KV-aware router's (at the first --target).
    headline = {router: s for (router, target), s in summary.items() if target in (None, first)}
    checks = target_checks(headline)
    print_router_lines(meta, checks)
    out = {**flat_json(headline, meta), **checks}
    if len(args.targets) > 1:
        out.update(finish_sweep(args.targets, args.routers, summary, meta, args.plot_out))
    if rounds:
        out.update(finish_rounds(args, rounds, runs, meta))
    out["wall_s"] = round(time.perf_counter() - wall_start, 1)
    print(json.dumps(out), flush=True)
    return 0


def finish_rounds(args: argparse.Namespace, rounds: List[Dict[RunKey, RunResult]],
                  pooled: Dict[RunKey, RunResult], meta: Dict[str, Any]) -> Dict[str, Any]:
    """--repeat: each round's figures and targets, and the pooled TTFT distributions' plot."""
    by_round = [{router: summarize(run) for (router, _), run in r.items()} for r in rounds]
    checks = [target_checks(s) for s in by_round]
    counts = rounds_json(by_round, checks)
    print_rounds(round_orders(args.routers, args.repeat), by_round, checks, counts)
    if "kv" in args.routers:
        comparisons = {other: paired(by_round, other) for other in args.routers if other != "kv"}
        print_paired(comparisons)
        counts.update({f"paired{json_suffix(other)}": figures
                       for other, figures in comparisons.items()})
    arrivals = (f"Poisson {meta['rate_req_s']} req/s reseeded each round"
                if meta.get("rate_req_s") else "the trace's arrivals")
    title = (f"{meta['num_requests']} requests x {len(rounds)} rounds, {arrivals}, "
             f"{meta['groups']} groups x {meta['kv_blocks']} blocks{host_tier(meta)}")
    plot_ttft({router: run for (router, _), run in pooled.items()}, args.plot_out, title)
    print(f"plot: {args.plot_out}")
    return {**counts, "plot": args.plot_out}


def engine_is_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TraceError, FileNotFoundError) as exc:
        print(f"bench_serve: {exc}", file=sys.stderr)
        sys.exit(2)
