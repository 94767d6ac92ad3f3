"""The prepared GPU check: one command for one lent H200 (no network, no Ray), every GPU-path
check of the engine in one run that finishes in a few minutes.

    python3 -m scripts.gpu_check --json-out $OUT/gpu_check.json   # CUDA (the point of it)
    python -m scripts.gpu_check --device cpu --quick                # tiny sizes on CPU (the test)

On a lent H200 (10 minutes of device time, the machine's start included), as one call:
``set -o pipefail; PYTHONUNBUFFERED=1 timeout 450 python3 -m scripts.gpu_check --json-out
$OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log`` with a call timeout of 480 s. Sections not
started within ``--time-budget-s`` (270 s) are skipped, so the JSON comes back even when the
device is slower than planned; the file is rewritten after every section in case of a kill.

Sections, each in its own module and each reporting its own failure without stopping the rest:

1. greedy_parity (``gpu_check_parity``): engine vs ``transformers`` greedy, TP 1, through ``LLM``
   and ``EngineConfig``, for every attention backend and CUDA-graph mode the config offers; fp32
   exact, bf16 with its token mismatch rate.
2. sampling (``gpu_check_parity``): temperature 1 with seeds, n=1 and n=3: reproducible, choice i
   from seed+i, the same alone and in a batch.
3. throughput (``gpu_check_throughput``): a random Llama-3.2-1B-shaped model in bf16 on 64 Azure
   code trace requests: output tok/s, ``ratio_vs_hf_generate``, ``roofline_frac``.
4. memory_sizing (``gpu_check_memory``): an engine with ``--gpu-memory-utilization`` set to leave
   it 1 GiB: its pool fits there, the GPU stays within the fraction after generating, greedy ids
   equal ``transformers``, a fraction below what is in use is refused; on CPU, refused by name.
5. triton_attention (``gpu_check_attention``): ``kv.attention.triton_paged`` against the PyTorch paged
   attention, max abs error; "not available" while that module does not exist.
6. tier_copies (``gpu_check_tiers``): ``check_cuda_tiers.check_copies`` (pinned spill/restore
   GB/s vs a plain ``copy_``, corruption caught) and the checksum's GB/s.
7. fused_kernels (``scripts/gpu/fused_kernels.py``): the decoder layer's Triton kernels (add +
   RMSNorm, SiLU-mul, RoPE with the K/V write) vs the PyTorch expressions, max abs error in fp32
   and bf16; kernels per decoder layer in a decode step, fused and not (CUDA profiler, eager
   and in a CUDA graph), against the target of 12.

Checkpoints are built on the spot (``gpu_check_models``). Prints a section per check and, last,
one JSON object (``--json-out`` also writes it to a file). A skipped section is listed as such.
Exit status: 0 when no check failed, 1 when one did, 2 for a usage error (no CUDA device).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

SCRIPTS = Path(__file__).resolve().parent

# (name, module, function, what it checks)
SECTIONS = (
    ("greedy_parity", "scripts.gpu.parity", "check_greedy",
     "greedy ids vs transformers (fp32 exact, bf16 drift), every backend and graph mode"),
    ("sampling", "scripts.gpu.parity", "check_sampling",
     "temperature 1 with seeds, n=1 and n=3: reproducible and batch-independent"),
    # the headline figures before the longer checks, inside the time budget whatever they take
    ("throughput", "scripts.gpu.throughput", "check_throughput",
     "tpserve vs transformers generate, and vs the device's limit"),
    ("decode_steady", "scripts.gpu.decode_steady", "check_decode_steady",
     "decode-heavy batches, serial vs overlapped step loop: ms/step, GPU busy, host syncs"),
    ("memory_sizing", "scripts.gpu.memory", "check_memory_sizing",
     "--gpu-memory-utilization: the KV pool sized from free memory, and held to it"),
    ("triton_attention", "scripts.gpu.attention", "check_triton_attention",
     "Triton paged attention vs the PyTorch reference"),
    ("tier_copies", "scripts.gpu.tiers", "check_tier_copies",
     "pinned spill/restore GB/s vs plain copy_, checksums"),
    ("fused_kernels", "scripts.gpu.fused_kernels", "check_fused_kernels",
     "fused layer kernels vs the PyTorch expressions; kernels per decode layer"),
)
SECTION_NAMES = tuple(s[0] for s in SECTIONS)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU test run)")
    p.add_argument("--sections", default=",".join(SECTION_NAMES),
                   help=f"comma-separated subset of {','.join(SECTION_NAMES)}")
    p.add_argument("--time-budget-s", type=float, default=270.0,
                   help="sections not started by then are skipped (the JSON still comes)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--blocks", type=int, default=None,
                   help="tier copy blocks of 720 KiB (default 256; 8 with --quick)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="throughput requests from the trace (default 64; 8 with --quick)")
    p.add_argument("--prompt-scale", type=float, default=None,
                   help="throughput prompt lengths x (default 1; 1/32 with --quick)")
    p.add_argument("--output-scale", type=float, default=None,
                   help="throughput output lengths x (default 1)")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTION_NAMES]
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {','.join(SECTION_NAMES)}")
    if args.device == "cpu" and not args.quick:
        p.error("--device cpu needs --quick: the full sizes (a 1B-parameter model) are for a GPU")
    if args.blocks is not None and args.blocks < 1:
        p.error("--blocks must be at least 1")
    for name in ("prompt_scale", "output_scale"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def run_section(name: str, module: str, function: str, ctx, report) -> None:
    """Run one section into ``report``; an exception (an import included) becomes its error."""
    from scripts.gpu.common import free_device_memory, synchronize

    started = time.perf_counter()
    try:
        getattr(importlib.import_module(module), function)(ctx, report)
        synchronize()  # an asynchronous fault of this section is raised here
    except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
        traceback.print_exc()
        report.error = f"{type(exc).__name__}: {exc}"
        print(f"  ERROR   {report.error}", flush=True)
    finally:
        report.seconds = time.perf_counter() - started
        freeing = free_device_memory()
        if freeing is not None and report.error is None:
            report.error = f"freeing device memory after the section: {freeing}"
            print(f"  ERROR   {report.error}", flush=True)


def run_sections(ctx, args: argparse.Namespace, started: float, header: Dict[str, object],
                 reports: List) -> None:
    """Each selected section in turn, appended to ``reports`` as it starts."""
    from scripts.gpu.common import Report

    for name, module, function, what in SECTIONS:
        if name not in args.sections:
            continue
        report = Report(name)
        reports.append(report)
        elapsed = time.perf_counter() - started
        print(f"\n== {name}: {what}", flush=True)
        if elapsed > args.time_budget_s:
            report.skipped = f"time budget {args.time_budget_s:g} s spent ({elapsed:.0f} s)"
            print(f"  SKIPPED {report.skipped}", flush=True)
        else:
            run_section(name, module, function, ctx, report)
            print(f"  -> {report.status} in {report.seconds:.1f} s", flush=True)
        _write_json(args.json_out, summary(header, reports, started, complete=False))


def summary(header: Dict[str, object], reports, started: float,
            complete: bool = True) -> Dict[str, object]:
    from scripts.gpu.common import ERROR, FAILED, NOT_AVAILABLE, SKIPPED

    def named(*statuses):
        return [r.name for r in reports if r.status in statuses]
    failed = named(FAILED, ERROR)
    return {**header, "passed": not failed, "failed": failed, "skipped": named(SKIPPED),
            "not_available": named(NOT_AVAILABLE), "complete": complete,
            "wall_s": round(time.perf_counter() - started, 1),
            "sections": {r.name: r.as_dict() for r in reports}}


def _write_json(path: Optional[Path], result: Dict[str, object]) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1) + "\n")


def describe_machine(args: argparse.Namespace) -> Dict[str, object]:
    import torch
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = args.device == "cuda"
    return {"script": "gpu_check", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "device_type": args.device, "quick": args.quick, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "triton": triton_version,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32 if cuda else None}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.device == "cpu":  # Triton runs CPU tensors only under its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; pass --device cpu --quick for the CPU run",
              file=sys.stderr)
        return 2
    from scripts.gpu.common import CheckContext

    header = describe_machine(args)
    print(json.dumps(header), flush=True)
    reports: List = []
    runner_error = None
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            ctx = CheckContext(torch.device(args.device), args.quick, Path(tmp), args)
            run_sections(ctx, args, started, header, reports)
    except Exception as exc:  # noqa: BLE001 - the summary below must still be printed
        traceback.print_exc()
        runner_error = f"{type(exc).__name__}: {exc}"
    result = summary(header, reports, started)
    if runner_error is not None:
        result.update(passed=False, runner_error=runner_error)
    print(f"\n{'PASSED' if result['passed'] else 'FAILED: ' + ', '.join(result['failed'])}"
          f" in {result['wall_s']:.0f} s; skipped: {result['skipped'] or 'none'}; "
          f"not available: {result['not_available'] or 'none'}")
    _write_json(args.json_out, result)
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
