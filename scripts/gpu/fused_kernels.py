"""Fused-kernels section of ``scripts/gpu_check.py``: the decoder layer's Triton kernels (residual
add + RMSNorm, SiLU-and-multiply, RoPE with the paged K/V write) against the PyTorch expressions
they replace, and the kernels one decoder layer launches in a decode step.

Errors: each kernel's largest absolute difference from its expression (`TorchLayerOps`), over
the largest magnitude of the expression's output (at least 1), on the Llama-3.2-1B shape (hidden 2048, 32 query heads and 8 KV heads of 64, intermediate 8192), 64
decode tokens, in fp32 and bf16; the K/V cache rows written count with the keys.

Kernel count: one decoder layer's decode forward (`scripts.gpu.kernel_count.decode_layer_step`,
its attention sized as a CUDA graph sizes it), fused and unfused. On a GPU, the kernels the CUDA
profiler records for one run (memsets and copies included: they are launches too), and the
same for a replay of the layer captured in a CUDA graph (a figure only); on CPU (``--quick``), the dispatched
kernels counted under Triton's interpreter (`count_kernels`). The target: at most 12 fused.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from scripts.gpu.common import CheckContext, Report

MAX_KERNELS_PER_LAYER = 12
# Relative to the largest output: RMSNorm's sum of squares in another order may flip the last
# bit of a rounded row (bf16: 2^-7 relative, and the weight multiplies it); a wrong kernel errs
# by the size of its values.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def kernel_errors(device: torch.device, dtype: torch.dtype, tokens: int, hidden: int,
                  heads: int, kv_heads: int, intermediate: int) -> Dict[str, float]:
    """Max abs difference of each fused kernel from its PyTorch expression, over the largest
    magnitude of the expression's output (at least 1)."""
    from workers.models.layer_ops import TorchLayerOps, TritonLayerOps
    from workers.model_config import RopeConfig
    from workers.models.rope import RotaryEmbedding

    torch_ops, triton_ops = TorchLayerOps(), TritonLayerOps()
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    def err(got, want):
        scale = max(1.0, want.float().abs().max().item())
        return (got.float() - want.float()).abs().max().item() / scale
    x, residual, weight = rand(tokens, hidden, scale=3.0), rand(tokens, hidden), rand(hidden)
    errors = {}
    for name, res in (("add_rms_norm", residual), ("rms_norm", None)):
        got, want = triton_ops.add_rms_norm(x, res, weight, 1e-5), \
            torch_ops.add_rms_norm(x, res, weight, 1e-5)
        errors[name] = max(err(got[0], want[0]), err(got[1], want[1]))
    gate_up = rand(tokens, 2 * intermediate, scale=4.0)
    errors["silu_and_mul"] = err(triton_ops.silu_and_mul(gate_up),
                                 torch_ops.silu_and_mul(gate_up))
    head_dim = hidden // heads
    rotary = RotaryEmbedding(RopeConfig(theta=500000.0), head_dim, 4096, dtype, device)
    tables = rotary.tables(torch.randint(0, 4096, (tokens,), generator=gen).to(device))
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim)
    slots = torch.randperm(4 * tokens, generator=gen)[:tokens].to(device)
    k_cache, v_cache = rand(4 * tokens, kv_heads, head_dim), rand(4 * tokens, kv_heads, head_dim)
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
    want = torch_ops.rope_write_kv(qkv.clone(), tables, caches[0], caches[1], slots, heads,
                                   kv_heads)
    got = triton_ops.rope_write_kv(qkv.clone(), tables, caches[2], caches[3], slots, heads,
                                   kv_heads)
    errors["rope_q"] = err(got[0], want[0])
    errors["rope_k_and_cache"] = max(err(got[1], want[1]), err(caches[2], caches[0]))
    errors["cache_v"] = err(caches[3], caches[1])
    return errors


def profiled_kernels(run: Callable[[], object]) -> int:
    """Kernels (memsets and copies included) the CUDA profiler records for one ``run()``."""
    from torch.profiler import ProfilerActivity, profile

    run()  # compiled and warm before the count
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def graph_kernels(run: Callable[[], object]) -> int:
    """`profiled_kernels` of a CUDA graph of ``run``, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up on a side stream, as the engine's captures do
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return profiled_kernels(graph.replay)


def layer_kernel_counts(ctx: CheckContext, dtype: torch.dtype, fused: bool) -> Dict[str, int]:
    from scripts.gpu.kernel_count import count_kernels, decode_layer_step, small_llama_config

    config = small_llama_config() if ctx.quick else small_llama_config(2048, 32, 8)
    step = decode_layer_step(ctx.device, dtype, fused, num_seqs=4 if ctx.quick else 64,
                             config=config)
    if not ctx.is_cuda:
        return {"dispatched": sum(count_kernels(step.run).values())}
    return {"profiled": profiled_kernels(step.run), "graph": graph_kernels(step.run)}


def check_fused_kernels(ctx: CheckContext, report: Report) -> None:
    dtypes = [torch.float32] if not ctx.is_cuda else [torch.float32, torch.bfloat16]
    shape: Dict[str, int] = dict(tokens=4, hidden=128, heads=4, kv_heads=2, intermediate=96)
    if not ctx.quick:
        shape = dict(tokens=64, hidden=2048, heads=32, kv_heads=8, intermediate=8192)
    for dtype in dtypes:
        key = str(dtype).replace("torch.", "")
        for name, error in kernel_errors(ctx.device, dtype, **shape).items():
            report.check(f"{name} {key}", error <= TOLERANCE[dtype],
                         f"max err / max |ref| {error:.2e} (tolerance {TOLERANCE[dtype]:g})")
        fused = layer_kernel_counts(ctx, dtype, fused=True)
        unfused = layer_kernel_counts(ctx, dtype, fused=False)
        for how, count in fused.items():
            report.figure(f"kernels_per_layer_{how}_{key}", count)
            report.figure(f"kernels_per_layer_{how}_unfused_{key}", unfused[how])
        # the eager count is checked; the graph's is a figure (what a profiler shows of a
        # replay depends on its CUPTI's support for graph nodes)
        counted = fused["profiled" if ctx.is_cuda else "dispatched"]
        report.check(f"kernels per decode layer {key}", 0 < counted <= MAX_KERNELS_PER_LAYER,
                     f"{fused} fused, {unfused} unfused (target <= {MAX_KERNELS_PER_LAYER})")
