"""Paged attention over block tables in plain PyTorch (runs on CPU and CUDA alike).

Decodes: on CPU in fp32 or bf16, a C kernel reads each sequence's keys and values where they lie
in the cache, and the step's query and output rows in place (``kv/attention/cpu_decode.py``).
Elsewhere, queries and the keys/values of every visible cached
position are gathered into padded dense tensors and attended with one
``scaled_dot_product_attention`` call. Grouped-query attention never repeats K/V there: the ``G``
query heads that share a KV head are folded into the query length, ``[B, Hkv, G, D]``, so a KV
head is read once for its whole group. Cost per layer: a gather of ``B * K`` K and V rows and
``B * H * K`` scores, ``K`` the longest context in the bucket or at most the sliding window: keys
that left the window are not gathered (nor read by the kernel) at all.

Prefills: one call per sequence over its exact context (no padding), causal without a mask when
nothing is cached before it. In bf16 on CPUs with AMX or AVX-512 BF16, prefills that no sliding
window cuts (up to `cpu_prefill.MAX_KEYS` keys) run on tpserve's kernel instead
(``kv/attention/cpu_prefill.py``), which reads their keys and values where they lie in the cache.
Cost per layer: ``H * query_len * K`` scores, ``K`` the keys its queries may see (the context, or
the window plus the chunk). On CPU a long chunk after a cached prefix (no window) is two flash
calls instead of one masked one, the prefix unmasked and the chunk causal, merged by log-sum-exp:
``H * q * (prefix + q / 2)`` scores. Grouped-query prefills read each K/V head where it lies for
its group of query heads where the fused kernel takes that (``gqa_in_place``: on CPU from torch 2.9, on CUDA FlashAttention's 16-bit unmasked
calls); elsewhere K/V are repeated per query head.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kv.attention.metadata import AttentionBucket, AttentionMetadata, PrefillSlice
from kv.attention.cpu_decode import decode_kernel, reference_attend
from kv.attention.cpu_prefill import PrefillKernel, prefill_kernel
from kv.kv_cache import gather_rows

# Torch's CPU flash attention with its log-sum-exp (what SDPA calls on CPU); None if this torch
# lacks it, and the masked call is used.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# The split pays above this many new tokens: torch's CPU kernel tiles keys by 512 for long
# inputs, so below that its causal call skips nothing. Measured (9 heads of 64, fp32): 0.81-0.88
# of the masked call's time at 640-1,024 new tokens, 0.95-1.17 at 128-512.
SPLIT_MIN_QUERY = 512
_TORCH_VERSION = torch.torch_version.TorchVersion(torch.__version__)
# SDPA's enable_gqa (torch 2.5 on): query heads read their group's K/V head in place. Only some
# fused kernels take it: elsewhere SDPA falls back to its math backend, which builds the whole
# [H, q, K] score matrix (8.6 GB for 32 heads of an 8,192-token prompt). FlashAttention on CUDA
# (and cuDNN's) takes it (16-bit only, unmasked), torch's CPU flash kernel from torch 2.9 on
# (masked too).
SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)
CPU_FLASH_HAS_GQA = _TORCH_VERSION >= (2, 9)
CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the step's new tokens over their sequences' cached keys and values.

    ``query`` is ``[T, H, D]``; ``k_cache``/``v_cache`` are ``[num_slots, Hkv, D]`` and already hold
    the new tokens' K/V. Returns ``[T, H * D]``.
    """
    num_tokens, num_heads, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads * head_dim)
    padded_query = None
    kernel = decode_kernel() if not query.is_cuda else None
    if kernel is not None and not kernel.accepts(query, k_cache, v_cache):
        kernel = None
    for bucket in metadata.buckets:
        if bucket.query_index.shape[1] == 1 and kernel is not None:  # read and written in place
            kernel.attend_rows(query, bucket.token_index, k_cache, v_cache, bucket.kv_slots,
                               bucket.mask.view(bucket.kv_slots.shape[0], -1), scale, out)
            continue
        if bucket.query_index.shape[1] == 1:  # decodes only: no padded rows to skip
            out.index_copy_(0, bucket.token_index,
                            _attend_decodes(query, k_cache, v_cache, bucket, scale))
            continue
        if padded_query is None:
            # One zero row at index T so padded query indices gather something harmless.
            padded_query = torch.cat([query, query.new_zeros(1, num_heads, head_dim)])
        out[bucket.token_index] = _attend_bucket(padded_query, k_cache, v_cache, bucket, scale)
    kernel = _prefill_kernel(query, k_cache, v_cache) if metadata.prefills else None
    for prefill in metadata.prefills:
        if kernel is not None and kernel.takes(prefill):
            kernel.attend(query, k_cache, v_cache, prefill, scale, out)
            continue
        out[prefill.start:prefill.end] = _attend_prefill(query, k_cache, v_cache, prefill, scale)
    return out


def _prefill_kernel(query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor) -> Optional[PrefillKernel]:
    """The CPU prefill kernel where it takes this step's tensors (bf16 on a CPU with AMX or
    AVX-512 BF16)."""
    if not PrefillKernel.accepts(query, k_cache, v_cache):
        return None
    return prefill_kernel()


def _attend_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    prefill: PrefillSlice, scale: float) -> torch.Tensor:
    num_heads, head_dim = query.shape[1:]
    group = num_heads // k_cache.shape[1]
    q = query[prefill.start:prefill.end].transpose(0, 1)  # [H, q, D]
    k = gather_rows(k_cache, prefill.kv_slots).transpose(0, 1)  # [Hkv, K, D]
    v = gather_rows(v_cache, prefill.kv_slots).transpose(0, 1)
    gqa = {}
    if group > 1 and gqa_in_place(query.device.type, query.dtype, prefill.mask is not None):
        gqa = {"enable_gqa": True}  # [Hkv, K, D] read in place by each group of query heads
    elif group > 1:
        k = k.repeat_interleave(group, dim=0)  # [H, K, D]
        v = v.repeat_interleave(group, dim=0)
    if (prefill.num_prefix_keys and prefill.end - prefill.start > SPLIT_MIN_QUERY
            and _CPU_FLASH is not None and not query.is_cuda):
        out = _attend_prefix_then_causal(q, k, v, prefill.num_prefix_keys, scale)
    else:
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=prefill.mask,
            is_causal=prefill.mask is None, scale=scale, **gqa)[0]  # [H, q, D]
    return out.transpose(0, 1).reshape(-1, num_heads * head_dim)


def gqa_in_place(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether a grouped-query prefill (masked or not) runs on a fused kernel that reads each K/V
    head in place for its group (else K/V are repeated per query head)."""
    if device_type == "cuda":
        return SDPA_HAS_GQA and not masked and dtype in CUDA_FLASH_DTYPES
    return CPU_FLASH_HAS_GQA


def _attend_prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               num_prefix: int, scale: float) -> torch.Tensor:
    """``[H, q, D]`` attention of a chunk over ``num_prefix`` cached keys that every query sees,
    then causally over its own keys (the last ``q`` of ``k``/``v``, ``[H or Hkv, K, D]``: torch's
    CPU flash kernel maps query heads to K/V heads by group itself): two flash calls merged by
    their log-sum-exps. The masked call it replaces scores all ``q * K`` pairs; this scores
    ``q * num_prefix + q * q / 2`` (a chunk half cached: 25% fewer)."""
    batch_q = q.unsqueeze(0)
    out_prefix, lse_prefix = _CPU_FLASH(  # [1, H, q, D], [1, H, q]
        batch_q, k[None, :, :num_prefix], v[None, :, :num_prefix], 0.0, False, scale=scale)
    out_new, lse_new = _CPU_FLASH(
        batch_q, k[None, :, num_prefix:], v[None, :, num_prefix:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_prefix, lse_new)
    out = (out_prefix.float() * (lse_prefix - lse).exp().unsqueeze(-1)
           + out_new.float() * (lse_new - lse).exp().unsqueeze(-1))
    return out[0].to(q.dtype)


def _attend_decodes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    bucket: AttentionBucket, scale: float) -> torch.Tensor:
    """A bucket of one query per sequence where the C kernel does not run: ``[B, H * D]``, in
    the order of ``token_index``. The same call as ``_attend_bucket`` makes for ``max_q == 1``,
    without its padding copies."""
    num_seqs = bucket.token_index.shape[0]
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    q = query.index_select(0, bucket.token_index).view(
        num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    # gathered K/V [B, Hkv, K, D], the mask broadcast over the KV heads and their G query heads
    out = reference_attend(q, k_cache, v_cache, bucket.kv_slots, bucket.mask.view(num_seqs, -1),
                           scale)
    return out.reshape(num_seqs, num_heads * head_dim)


def _attend_bucket(
    padded_query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    bucket: AttentionBucket, scale: float,
) -> torch.Tensor:
    num_seqs, max_q = bucket.query_index.shape
    _, num_heads, head_dim = padded_query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    q = padded_query[bucket.query_index]  # [B, max_q, H, D]
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)  # [B, Hkv, G*max_q, D]
    k = gather_rows(k_cache, bucket.kv_slots).transpose(1, 2)  # [B, Hkv, K, D]
    v = gather_rows(v_cache, bucket.kv_slots).transpose(1, 2)  # [B, Hkv, K, D]
    mask = bucket.mask  # [B, 1, max_q, K]
    if group > 1:
        mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(
            num_seqs, 1, group * max_q, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_heads * head_dim)  # [B*max_q, H*D]
    return out.index_select(0, bucket.valid_rows)
