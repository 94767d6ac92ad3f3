#!/usr/bin/env python3
"""Compile tpserve's GPU kernels for NVIDIA GPUs on a machine without one: every launch of the
Triton attention kernels a step makes and of the decoder layer's fused kernels (residual add +
RMSNorm, SiLU-and-multiply, RoPE with the K/V cache write), for real model shapes and dtypes, through Triton's own CUDA
compiler and the ``ptxas`` it ships, as the first step on a GPU would compile them; and the CUDA C
kernels CuPy compiles at run time (the KV tiers' device checksum), through NVRTC
(``scripts/nvrtc_check.py``).

    python -m scripts.check_gpu_kernels                 # sm_90 (H100/H200), every shape
    python -m scripts.check_gpu_kernels --arch 80,90    # A100 and H100/H200
    python -m scripts.check_gpu_kernels --quick         # two shapes (the test suite's run)

Why: the suite runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``), which executes
them as NumPy and so accepts kernels the compiler rejects (shapes ``tl.dot`` cannot tile, types
the target lacks) and says nothing of registers or shared memory. Here the launches are built by
the same code as a step's (`kv.attention.triton_paged.decode_launches` / `prefill_launch`, on CPU
tensors shaped and typed as on the device) and compiled with ``kernel.warmup``: Triton binds and
specializes the arguments as for a launch, then compiles to PTX and, through ``ptxas``, to a
cubin, without launching. A check fails when a kernel does not compile, needs more shared memory
than the architecture allows a block, or spills registers (``ptxas -v``).

No GPU, no CUDA driver: Triton's active driver is replaced, for this process only, by one that
answers the target (`CompileOnlyDriver`); NVRTC needs none. Without NVRTC (the
``nvidia-cuda-nvrtc-cu12`` wheel, or a CUDA toolkit) the CUDA C part is skipped, with a line that
says so. Prints a line per kernel and, last, one JSON object; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# The kernels must be decorated as compiled, not interpreted: before kv.attention.triton_paged loads.
os.environ["TRITON_INTERPRET"] = "0"


import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402

from kv.attention import triton_paged as triton_attention  # noqa: E402
from kv.attention.triton_rope_write import rope_write_kv_launch  # noqa: E402
from workers.models.triton_layer_kernels import (  # noqa: E402
    add_rms_norm_launch, silu_and_mul_launch)
from scripts.nvrtc_check import (  # noqa: E402
    CUDA_KERNELS, Nvrtc, compile_cuda_kernel, find_nvrtc, kernel_problems, ptxas_figures)
from kv.attention.metadata import SeqSlice  # noqa: E402
from kv.attention.block_table_metadata import build_block_table_metadata  # noqa: E402

# Shared memory one block may use (opt-in maximum), by compute capability.
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
BLOCK_SIZE = 16  # tokens per KV block, the engine's default
CPU = torch.device("cpu")
_USAGE: Dict[str, Dict[str, int]] = {}  # kernel hash -> ptxas figures, in this process


@dataclass(frozen=True)
class Shape:
    """One model at TP 1: its attention (query heads, KV heads, head dim, sliding window) and its
    MLP's intermediate size."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: Optional[int] = None
    intermediate: int = 8192


SHAPES = (
    Shape("SmolLM2-135M", 9, 3, 64, intermediate=1536),  # GQA 3: a group padded to 4 rows
    Shape("Llama-2-7B", 32, 32, 128, intermediate=11008),  # MHA: one query row per decode tile
    Shape("Llama-3.2-1B", 32, 8, 64, intermediate=8192),
    Shape("Llama-3.1-8B", 32, 8, 128, intermediate=14336),
    Shape("Qwen2.5-7B", 28, 4, 128, intermediate=18944),  # GQA 7
    Shape("Mistral-7B-v0.1", 32, 8, 128, window=4096, intermediate=14336),
    Shape("MQA, 16 heads", 16, 1, 128, intermediate=8192),  # one KV head: the whole group
)
QUICK_SHAPES = ("SmolLM2-135M", "Mistral-7B-v0.1")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The steps each shape is compiled for, as (cached tokens, new tokens) per sequence: decodes with
# one split (many short ones) and with several (few long ones), prefills over a cached prefix
# in long chunks (BLOCK_M 64) and short ones (BLOCK_M 16).
STEPS = {
    "decode": [(100, 1)] * 64,
    "decode, split": [(3000, 1)] * 2,
    "prefill": [(500, 300), (0, 64)],
    "prefill, short": [(40, 3), (7, 9)],
}


class CompileOnlyDriver(DriverBase):
    """Triton's driver for compiling without a device: it names the target, and has nothing to
    launch on (``kernel.warmup`` compiles only). Its device number is the target's capability:
    a kernel keeps its compiled variants and its target per device, so each target needs its
    own number, or a second one would get the first one's kernels back."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("compile only: nothing is launched")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return CPU

    def get_benchmarker(self):
        raise NotImplementedError("compile only: nothing is timed")

    def get_current_device(self) -> int:
        return self.target.arch

    def get_current_stream(self, device: int) -> int:
        return 0


def step_launches(shape: Shape, dtype: torch.dtype,
                  seqs: Sequence[tuple]) -> List[triton_attention.KernelLaunch]:
    """The launches of one step of ``seqs`` ((cached, new) each) for ``shape``, on CPU tensors."""
    slices, next_block = [], 0
    for num_computed, query_len in seqs:
        num_blocks = -(-(num_computed + query_len) // BLOCK_SIZE)
        slices.append(SeqSlice(query_len, num_computed,
                               list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    meta = build_block_table_metadata(slices, BLOCK_SIZE, CPU, [shape.window])[0]
    num_tokens = sum(new for _, new in seqs)
    query = torch.empty(num_tokens, shape.heads, shape.head_dim, dtype=dtype)
    k_cache = torch.empty(next_block * BLOCK_SIZE, shape.kv_heads, shape.head_dim, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    out = torch.empty(num_tokens, shape.heads * shape.head_dim, dtype=dtype)
    scale = shape.head_dim ** -0.5
    launches = []
    if meta.num_decodes:
        launches += triton_attention.decode_launches(query, k_cache, v_cache, meta, scale, out)
    if meta.prefill_ids.shape[0]:
        launches.append(triton_attention.prefill_launch(query, k_cache, v_cache, meta,
                                                        meta.prefill_ids, scale, out))
    return launches


def layer_launches(shape: Shape, dtype: torch.dtype,
                   num_tokens: int = 64) -> List[triton_attention.KernelLaunch]:
    """The fused decoder-layer kernels of a step of ``num_tokens`` for ``shape``: the norm with a
    residual and without (the first layer's), SiLU-and-multiply, RoPE with the cache write."""
    hidden = shape.heads * shape.head_dim
    x = torch.empty(num_tokens, hidden, dtype=dtype)
    weight = torch.empty(hidden, dtype=dtype)
    qkv = torch.empty(num_tokens, (shape.heads + 2 * shape.kv_heads) * shape.head_dim,
                      dtype=dtype)
    cache = torch.empty(4 * num_tokens, shape.kv_heads, shape.head_dim, dtype=dtype)
    tables = (torch.empty(num_tokens, 1, shape.head_dim, dtype=dtype),) * 2
    slots = torch.empty(num_tokens, dtype=torch.long)
    return [add_rms_norm_launch(x, x, weight, 1e-5, x, x),
            add_rms_norm_launch(x, None, weight, 1e-5, x, None),
            silu_and_mul_launch(torch.empty(num_tokens, 2 * shape.intermediate, dtype=dtype),
                                torch.empty(num_tokens, shape.intermediate, dtype=dtype)),
            rope_write_kv_launch(qkv, tables, cache, cache, slots, shape.heads, shape.kv_heads)]


def compile_launch(launch: triton_attention.KernelLaunch, arch: int) -> Dict:
    """Compile one launch for ``arch``; its figures and what is wrong with it (``problems``).
    Triton runs ``ptxas -v`` itself and prints its log (``dump_ptxas_log``), read here: the
    figures are those of the cubin Triton built, with its own ptxas options."""
    started = time.perf_counter()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constexprs)
    compile_s = time.perf_counter() - started
    usage = _USAGE.get(kernel.hash)
    if usage is None:  # two launches may specialize to one kernel: compiled (and logged) once
        usage = ptxas_figures(log.getvalue())
        if usage is None:
            raise RuntimeError(f"no ptxas -v figures in Triton's ptxas log: "
                               f"{log.getvalue()[-2000:]!r}")
        _USAGE[kernel.hash] = usage
    shared = kernel.metadata.shared  # Triton's figure: what a launch asks the device for
    return {"kernel": kernel.name, "num_warps": kernel.metadata.num_warps,
            "shared_bytes": shared, "registers": usage["registers"],
            "spill_bytes": usage["spill_bytes"], "compile_s": round(compile_s, 2),
            "problems": kernel_problems(bool(kernel.asm.get("cubin")), shared,
                                        usage["spill_bytes"], MAX_SHARED_BYTES[arch])}


def with_block_m(launch: triton_attention.KernelLaunch,
                 block_m: Optional[int]) -> triton_attention.KernelLaunch:
    """``launch`` with ``block_m`` query rows per prefill program instead of the engine's (to try
    tile sizes; compiled only, so the grid is left as it was)."""
    if block_m is None or "BLOCK_M" not in launch.constexprs:
        return launch
    return launch._replace(constexprs={**launch.constexprs, "BLOCK_M": block_m})


def shape_launches(shape: Shape, dtype: torch.dtype):
    """``(step name, launch)`` of every step in ``STEPS`` and of the decoder layer's kernels."""
    launches = [(step, launch) for step, seqs in STEPS.items()
                for launch in step_launches(shape, dtype, seqs)]
    return launches + [("layer", launch) for launch in layer_launches(shape, dtype)]


def compile_or_report(launch: triton_attention.KernelLaunch, arch: int) -> Dict:
    """`compile_launch`'s row, or the compile error as its problem (the finding to report)."""
    try:
        return compile_launch(launch, arch)
    except Exception as e:  # noqa: BLE001 - a compile error is the finding: report it
        return {"kernel": launch.kernel.fn.__name__,
                "problems": [f"{type(e).__name__}: {e}"[:2000]]}


def run(arches: Sequence[int], shapes: Sequence[Shape], dtypes: Sequence[str],
        prefill_block_m: Optional[int] = None) -> Dict:
    rows, failures = [], 0
    for arch in arches:
        # For the rest of this process: it compiles only (there is no driver to go back to).
        triton.runtime.driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
        for shape in shapes:
            for dtype in dtypes:
                for step, launch in shape_launches(shape, DTYPES[dtype]):
                    row = {"arch": arch, "shape": shape.name, "dtype": dtype, "step": step}
                    row.update(compile_or_report(with_block_m(launch, prefill_block_m), arch))
                    failures += bool(row["problems"])
                    rows.append(row)
                    print_row(row)
    nvrtc_path = find_nvrtc()
    nvrtc = Nvrtc(nvrtc_path) if nvrtc_path else None
    if nvrtc is None:
        print("CUDA C kernels: skipped, no NVRTC here (pip install nvidia-cuda-nvrtc-cu12)")
    for arch in arches if nvrtc is not None else ():
        for name, source in CUDA_KERNELS:
            row = {"arch": arch, "shape": "-", "dtype": "-", "step": "KV block checksum",
                   **compile_cuda_kernel(nvrtc, name, source, arch, MAX_SHARED_BYTES[arch])}
            failures += bool(row["problems"])
            rows.append(row)
            print_row(row)
    return {"ok": failures == 0, "num_compiled": len(rows), "num_failed": failures,
            "arches": list(arches), "triton": triton.__version__,
            "nvrtc": nvrtc.version() if nvrtc else None,
            "num_cuda_c_compiled": sum(r["kernel"] in dict(CUDA_KERNELS) for r in rows),
            "max_registers": max((r.get("registers", 0) for r in rows), default=0),
            "max_shared_bytes": max((r.get("shared_bytes", 0) for r in rows), default=0),
            "spill_bytes": sum(r.get("spill_bytes", 0) for r in rows),
            "failures": [r for r in rows if r["problems"]]}


def print_row(row: Dict) -> None:
    status = "FAIL " + "; ".join(row["problems"]) if row["problems"] else "ok"
    figures = ""
    if "registers" in row:
        figures = (f"{row['registers']:3d} regs  {row['shared_bytes']:6d} B shared  "
                   f"{row['num_warps']:>1} warps  {row['compile_s']:5.2f} s")
    print(f"sm_{row['arch']} {row['shape']:<16} {row['dtype']:<4} {row['step']:<15} "
          f"{row['kernel']:<22} {figures}  {status}", flush=True)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90",
                   help=f"comma-separated compute capabilities, of {sorted(MAX_SHARED_BYTES)}")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help=f"of {', '.join(DTYPES)}")
    p.add_argument("--quick", action="store_true",
                   help=f"only {' and '.join(QUICK_SHAPES)}, in bf16 and fp32")
    p.add_argument("--prefill-block-m", type=int, default=None,
                   help="query rows per prefill program instead of the engine's choice (a power "
                        "of two, 16 or more): to see what another tile size costs")
    args = p.parse_args(argv)
    block_m = args.prefill_block_m
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        p.error(f"--prefill-block-m: expected a power of two of at least 16, got {block_m}")
    try:
        args.arches = [int(a) for a in args.arch.split(",")]
    except ValueError:
        p.error(f"--arch: expected comma-separated integers such as 80,90, got {args.arch!r}")
    unknown = [a for a in args.arches if a not in MAX_SHARED_BYTES]
    if unknown:
        p.error(f"--arch: no shared-memory limit known for {unknown}; "
                f"expected some of {sorted(MAX_SHARED_BYTES)}")
    args.dtype_names = args.dtypes.split(",")
    bad = [d for d in args.dtype_names if d not in DTYPES]
    if bad:
        p.error(f"--dtypes: unknown {bad}; expected some of {', '.join(DTYPES)}")
    if args.quick:
        args.dtype_names = [d for d in args.dtype_names if d != "fp16"] or args.dtype_names
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    shapes = [s for s in SHAPES if not args.quick or s.name in QUICK_SHAPES]
    # A cache of this run's own: every kernel is compiled (a cached one would bring no ptxas
    # log), and nothing is left in the user's Triton cache.
    with tempfile.TemporaryDirectory(prefix="tpserve-triton-") as cache:
        triton.knobs.cache.dir = cache
        triton.knobs.nvidia.dump_ptxas_log = True
        result = run(args.arches, shapes, args.dtype_names, args.prefill_block_m)
    nvrtc = f" and NVRTC {result['nvrtc']}" if result["nvrtc"] else ""
    print(f"{result['num_compiled']} kernels compiled for sm_{', sm_'.join(map(str, args.arches))} "
          f"with Triton {result['triton']}{nvrtc}: {result['num_failed']} failed; at most "
          f"{result['max_registers']} registers and {result['max_shared_bytes']} bytes of shared "
          f"memory a block, {result['spill_bytes']} bytes spilled")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
