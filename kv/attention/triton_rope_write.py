"""Rotary embedding of q and k fused with the paged K/V cache write, in one Triton kernel (the CUDA
path; imported only there and in tests under Triton's interpreter).

The step's packed projection output ``qkv`` ``[T, (H + 2 Hkv) * D]`` holds each token's query
heads, then its key heads, then its value heads. One program per (token, query or key head):

    query head h < H:       q[t, h] rotated in place
    key head j (h = H + j): k[t, j] rotated in place, and written with v[t, j] to the token's slot
                            of ``k_cache``/``v_cache`` [num_slots, Hkv, D] (``slot_mapping[t]``)

The rotation is ``x * cos + rotate_half(x) * sin`` with the step's tables (`RotaryEmbedding.tables`),
rounded where that PyTorch expression rounds: each product to the dtype, then their sum. fp32
launches turn off the compiler's multiply-add contraction, so they round as PyTorch does too.
k is rotated in place as well as written: attention that reads the step's new keys directly
(SDPA on fresh prefills) finds them rotated.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from kv.attention.triton_paged import KernelLaunch


@triton.jit
def _rotate_half_pair(x1, x2, c1, c2, s1, s2):
    """``(x * cos + rotate_half(x) * sin)`` by halves, each product and the sum rounded to the
    inputs' dtype as PyTorch's elementwise ops round."""
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt)
    b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dt)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dt)
    return (a1.to(tl.float32) + b1.to(tl.float32)).to(dt), \
        (a2.to(tl.float32) + b2.to(tl.float32)).to(dt)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_t, stride_cos, stride_slot, stride_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = tl.arange(0, HALF_PAD)
    ok = offs < HALF
    row = qkv_ptr + token * stride_t + head * (2 * HALF)
    x1 = tl.load(row + offs, mask=ok, other=0.0)
    x2 = tl.load(row + HALF + offs, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + token * stride_cos + offs, mask=ok, other=0.0)
    c2 = tl.load(cos_ptr + token * stride_cos + HALF + offs, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + token * stride_cos + offs, mask=ok, other=0.0)
    s2 = tl.load(sin_ptr + token * stride_cos + HALF + offs, mask=ok, other=0.0)
    o1, o2 = _rotate_half_pair(x1, x2, c1, c2, s1, s2)
    tl.store(row + offs, o1, mask=ok)
    tl.store(row + HALF + offs, o2, mask=ok)
    if head >= NUM_HEADS:
        kv_head = head - NUM_HEADS
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        dest = slot * stride_slot + kv_head * stride_head
        tl.store(k_cache_ptr + dest + offs, o1.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(k_cache_ptr + dest + HALF + offs, o2.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v_row = row + NUM_KV_HEADS * (2 * HALF)
        v1 = tl.load(v_row + offs, mask=ok, other=0.0)
        v2 = tl.load(v_row + HALF + offs, mask=ok, other=0.0)
        tl.store(v_cache_ptr + dest + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + dest + HALF + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=ok)


def _check(qkv: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
           v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> int:
    """The head dim, after checking every layout the kernel assumes."""
    head_dim = k_cache.shape[-1]
    if qkv.dim() != 2 or qkv.stride(-1) != 1 or \
            qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv: expected [tokens, ({num_heads} + 2 * {num_kv_heads}) * "
                         f"{head_dim}] with contiguous rows, got {tuple(qkv.shape)}")
    if head_dim % 2 or k_cache.shape[1] != num_kv_heads or k_cache.stride(-1) != 1 \
            or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache/v_cache: expected [num_slots, {num_kv_heads}, even head dim] "
                         f"sharing one layout, got {tuple(k_cache.shape)} {k_cache.stride()} and "
                         f"{tuple(v_cache.shape)} {v_cache.stride()}")
    for table in tables:
        if table.shape[0] != qkv.shape[0] or table.shape[-1] != head_dim or table.stride(-1) != 1:
            raise ValueError(f"rope tables: expected [{qkv.shape[0]}, 1, {head_dim}] with "
                             f"contiguous rows, got {tuple(table.shape)}")
    return head_dim


def rope_write_kv_launch(qkv: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor],
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         num_heads: int, num_kv_heads: int) -> KernelLaunch:
    """`rope_write_kv`'s launch."""
    head_dim = _check(qkv, tables, k_cache, v_cache, num_heads, num_kv_heads)
    cos, sin = tables
    assert cos.stride(0) == sin.stride(0), "cos and sin tables must share a layout"
    return KernelLaunch(_rope_write_kv_kernel, (qkv.shape[0], num_heads + num_kv_heads), (
        qkv, cos, sin, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1)), dict(
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=qkv.dtype != torch.float32))


def rope_write_kv(qkv: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor],
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> None:
    """Rotate the queries and keys of ``qkv`` ``[T, (H + 2 Hkv) * D]`` in place by ``tables``
    (cos, sin ``[T, 1, D]``) and store each token's rotated keys and its values at its slot
    ``slot_mapping[t]`` of ``k_cache``/``v_cache`` ``[num_slots, Hkv, D]``. One launch."""
    rope_write_kv_launch(qkv, tables, k_cache, v_cache, slot_mapping, num_heads,
                         num_kv_heads).launch()
