"""Triton attention section of ``scripts/gpu_check.py``: the Triton backend's output against the
PyTorch reference's, largest absolute difference per case and dtype.

Runs when the Triton kernels module ``kv.attention.triton_paged`` imports (else "not available", saying
whether the module or the ``triton`` package is missing). Both sides are driven through
``kv.attention.backend`` exactly as a model layer drives them: ``build_metadata`` for the step,
then ``forward`` (write the new K/V into the paged cache, attend). The reference is the torch
backend in fp32 on the same rounded inputs. The Triton backend runs as the engine builds it and,
where it takes ``sdpa_fresh_prefills``, once more with its paged prefill kernel on every prefill.

Cases: decodes over many context lengths (two decode buckets, contexts across tile and block
edges), fresh prefills, prefills over a cached prefix mixed with decodes, and a sliding window
whose blocks wholly before the window hold NaN (neither side may read them). Every sequence's
blocks are scattered at random over the pool; GQA throughout.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from scripts.gpu.common import CheckContext, Report
from kv.attention.metadata import SeqSlice, first_key_position

TRITON_MODULE = "kv.attention.triton_paged"
BLOCK_SIZE = 16
# The kernels keep fp32 dots in IEEE fp32, but the reference's own fp32 kernels may use TF32 on
# a GPU (~1e-3); bf16 outputs round at ~4e-3 and sum bf16 products. A bug errs by O(1).
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    seqs: Tuple[Tuple[int, int], ...]  # per sequence: (query_len, num_computed)
    sliding_window: Optional[int] = None


CASES = (
    AttentionCase("decode", tuple((1, n) for n in (0, 1, 7, 15, 16, 17, 31, 33, 63, 64, 65, 100,
                                                   127, 128, 200, 255, 300, 384, 511, 700))),
    AttentionCase("prefill", ((37, 0), (64, 0), (5, 0), (129, 0))),
    AttentionCase("prefix+decode", ((23, 40), (1, 70), (1, 3), (50, 0), (1, 129), (16, 16))),
    AttentionCase("window", ((23, 40), (1, 70), (1, 200), (50, 0), (90, 0)), sliding_window=32),
)


def import_backends() -> Tuple[Optional[Callable], Optional[str]]:
    """``(make_attention_backend, None)``, or ``(None, why not)`` when the Triton module, the
    ``triton`` package or the backend interface is missing; other import errors propagate."""
    try:
        importlib.import_module(TRITON_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == TRITON_MODULE:
            return None, f"{TRITON_MODULE} does not exist in this tree"
        return None, f"{TRITON_MODULE} needs {exc.name}, which is not installed here"
    try:
        backends = importlib.import_module("kv.attention.backend")
    except ModuleNotFoundError as exc:
        return None, f"{TRITON_MODULE} exists but {exc.name} (the backend interface) does not"
    return backends.make_attention_backend, None


def triton_variants(make: Callable) -> Dict[str, Callable[[], object]]:
    """The Triton backend as the engine builds it, and with paged prefill kernels only."""
    variants = {"triton": lambda: make("triton")}
    cls = type(make("triton"))
    if "sdpa_fresh_prefills" in inspect.signature(cls).parameters:
        variants["triton paged-prefill"] = lambda: cls(sdpa_fresh_prefills=False)
    return variants


def make_inputs(case: AttentionCase, heads: Tuple[int, int, int], dtype: torch.dtype,
                device: torch.device, seed: int = 0):
    """Query ``[T, H, D]``, new K/V ``[T, Hkv, D]``, caches ``[slots, Hkv, D]`` and the seqs."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil((q + c) / BLOCK_SIZE) for q, c in case.seqs]
    order = torch.randperm(sum(blocks_per_seq) + 3, generator=gen).tolist()
    seqs, taken = [], 0
    for (query_len, num_computed), n in zip(case.seqs, blocks_per_seq):
        seqs.append(SeqSlice(query_len, num_computed, order[taken:taken + n]))
        taken += n

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    num_tokens, num_slots = sum(q for q, _ in case.seqs), len(order) * BLOCK_SIZE
    tensors = [rand(num_tokens, num_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim),
               rand(num_tokens, num_kv_heads, head_dim), rand(num_slots, num_kv_heads, head_dim),
               rand(num_slots, num_kv_heads, head_dim)]
    if case.sliding_window is not None:
        for cache in tensors[3:]:
            _poison_left_window(cache, seqs, case.sliding_window)
    return [t.to(device) for t in tensors], seqs


def _poison_left_window(cache: torch.Tensor, seqs: List[SeqSlice], window: int) -> None:
    """NaN in every block wholly before the first key a sequence's queries can see."""
    for seq in seqs:
        for block in seq.block_ids[:first_key_position(seq.num_computed, window) // BLOCK_SIZE]:
            cache[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE] = float("nan")


def run_backend(backend, tensors, seqs, window: Optional[int], scale: float) -> torch.Tensor:
    query, key, value, k_cache, v_cache = tensors
    metadata = backend.build_metadata(seqs, BLOCK_SIZE, query.device, [window])[0]
    return backend.forward(query, key, value, k_cache.clone(), v_cache.clone(), metadata, scale)


def attention_error(make_reference, make_triton, case, heads, dtype, device) -> float:
    tensors, seqs = make_inputs(case, heads, dtype, device)
    scale = heads[2] ** -0.5
    want = run_backend(make_reference(), [t.float() for t in tensors], seqs, case.sliding_window,
                       scale)
    got = run_backend(make_triton(), tensors, seqs, case.sliding_window, scale)
    return (got.float() - want).abs().max().item()  # NaN if either side read a poisoned slot


def triton_configs(ctx: CheckContext) -> List[Tuple[Tuple[int, int, int], torch.dtype]]:
    """(heads, KV heads, head dim) and dtype: Llama-3.2-1B's heads in fp32 and bf16 and a
    head_dim-128 MQA-like case on a GPU; one small fp32 case under the CPU interpreter (whose
    bf16 arithmetic is not the GPU's)."""
    if not ctx.is_cuda:
        return [((4, 2, 16), torch.float32)]
    return [((32, 8, 64), torch.float32), ((32, 8, 64), torch.bfloat16),
            ((16, 2, 128), torch.bfloat16)]


def check_triton_attention(ctx: CheckContext, report: Report) -> None:
    make, reason = import_backends()
    if make is None:
        report.unavailable("triton attention", reason)
        return
    worst: Dict[str, float] = {}
    for variant, make_triton in triton_variants(make).items():
        for heads, dtype in triton_configs(ctx):
            for case in CASES:
                err = attention_error(lambda: make("torch"), make_triton, case, heads, dtype,
                                      ctx.device)
                key = str(dtype).replace("torch.", "")
                worst[key] = max(worst.get(key, 0.0), err if math.isfinite(err) else math.inf)
                report.check(f"{variant} {case.name} H{heads[0]}/{heads[1]} D{heads[2]} {key}",
                             err <= TOLERANCE[dtype],
                             f"max abs err {err:.2e} (tolerance {TOLERANCE[dtype]:g})")
    for key, err in worst.items():
        report.figure(f"max_abs_err_{key}", err)
