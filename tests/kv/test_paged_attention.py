"""Paged attention over scattered blocks equals dense causal attention on contiguous tensors."""

import random

import pytest
import torch

from attention_reference import dense_reference
from kv.attention.backend import TorchAttentionBackend
from kv.attention.metadata import DECODE_BUCKET_SIZE, SeqSlice, build_attention_metadata
from kv.kv_cache import KVCache, KVCacheSpec, write_kv
from kv.attention.torch_paged import (CPU_FLASH_HAS_GQA, SDPA_HAS_GQA, SPLIT_MIN_QUERY, gqa_in_place,
                                paged_attention)


MIXED = [(9, 1), (0, 11), (6, 7), (14, 1), (0, 1)]
# More decodes than one bucket holds, of scattered lengths (buckets sort and split them).
MANY_DECODES = [((i * 7) % 23, 1) for i in range(37)] + [(3, 5)]
# Chunks after long cached prefixes (on CPU: the prefix and the chunk attended apart, merged).
LONG_PREFIXES = [(40, 24), (3, 30), (17, 2), (40, SPLIT_MIN_QUERY + 88)]


def paged_case(heads, kv_heads, window, shapes, decode_bucket_size=DECODE_BUCKET_SIZE):
    """Scattered cache blocks holding each sequence's prefix, the step's metadata and queries,
    and the dense reference: ``(run, expected, meta)``, ``run()`` attending the paged way."""
    torch.manual_seed(0)
    rng = random.Random(0)
    block_size, head_dim, num_blocks = 4, 8, 256
    k_cache = torch.zeros(num_blocks * block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)  # blocks scattered across the pool
    # shapes: (cached prefix length, new tokens) per sequence
    seqs, full_k, full_v, queries = [], [], [], []
    for num_computed, q_len in shapes:
        ctx = num_computed + q_len
        blocks = [free_blocks.pop() for _ in range(-(-ctx // block_size))]
        k = torch.randn(ctx, kv_heads, head_dim)
        v = torch.randn(ctx, kv_heads, head_dim)
        prefix_slots = [blocks[p // block_size] * block_size + p % block_size
                        for p in range(num_computed)]
        k_cache[prefix_slots] = k[:num_computed]
        v_cache[prefix_slots] = v[:num_computed]
        seqs.append(SeqSlice(q_len, num_computed, blocks))
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(q_len, heads, head_dim))
    meta = build_attention_metadata(seqs, block_size, torch.device("cpu"), window,
                                    decode_bucket_size)
    new_k = torch.cat([k[s.num_computed:] for k, s in zip(full_k, seqs)])
    new_v = torch.cat([v[s.num_computed:] for v, s in zip(full_v, seqs)])
    write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
    expected = torch.cat([dense_reference(q, k, v, s.num_computed, window)
                          for q, k, v, s in zip(queries, full_k, full_v, seqs)])
    query = torch.cat(queries)

    def run():
        return paged_attention(query, k_cache, v_cache, meta, head_dim ** -0.5)

    return run, expected, meta


@pytest.mark.parametrize("heads,kv_heads,window,shapes", [
    (4, 4, None, MIXED), (4, 2, None, MIXED), (6, 1, 5, MIXED), (4, 2, None, MANY_DECODES),
    (4, 2, None, LONG_PREFIXES), (4, 4, 50, LONG_PREFIXES)])
def test_paged_matches_dense(heads, kv_heads, window, shapes, decode_path):
    run, expected, meta = paged_case(heads, kv_heads, window, shapes)
    out = run()
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    firsts = [sum(q_len for _, q_len in shapes[:i]) for i in range(len(shapes))]
    assert [meta.positions.tolist()[i] for i in firsts] == [c for c, _ in shapes]


@pytest.mark.parametrize("window", [None, 5])
def test_every_decode_in_one_bucket_matches_dense(window, decode_path):
    """The CPU decode kernel's bucketing: 37 decodes of scattered lengths, one call a layer."""
    run, expected, meta = paged_case(4, 2, window, MANY_DECODES, decode_bucket_size=None)
    assert len(meta.buckets) == 1 and meta.buckets[0].kv_slots.shape[0] == 37
    torch.testing.assert_close(run(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [0, -16])
def test_a_decode_bucket_size_under_one_is_refused_by_name(size):
    with pytest.raises(ValueError, match=f"decode_bucket_size must be at least 1 or None, got "
                                         f"{size}"):
        build_attention_metadata([SeqSlice(1, 3, [0])], 4, torch.device("cpu"), None, size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_backend_buckets_decodes_for_the_path_that_runs_them(dtype, decode_path):
    """One bucket where the C kernel takes the cache (CPU, fp32 or bf16), buckets of 16
    elsewhere: the gather path pads each bucket's K/V to its longest context."""
    backend = TorchAttentionBackend()
    backend.prepare(KVCache(KVCacheSpec(1, 16, 4, 2, 8, dtype), torch.device("cpu")), 4)
    seqs = [SeqSlice(1, n, list(range(-(-(n + 1) // 4)))) for n in range(0, 40, 2)]
    meta = backend.build_metadata(seqs, 4, torch.device("cpu"), [None])[0]
    on_kernel = decode_path == "kernel"
    assert [b.kv_slots.shape[0] for b in meta.buckets] == ([20] if on_kernel else [16, 4])


@pytest.mark.skipif(not CPU_FLASH_HAS_GQA, reason="CPU flash attention takes GQA from torch 2.9")
@pytest.mark.parametrize("window,shapes", [(None, MIXED), (None, LONG_PREFIXES), (5, MIXED)])
def test_grouped_query_prefills_never_repeat_keys_and_values(window, shapes, monkeypatch):
    """Each query head reads its group's K/V head where it lies: no [H, K, D] copies of K and V
    (plain causal, split cached prefix and masked window prefills alike)."""
    run, expected, _ = paged_case(8, 2, window, shapes)

    def refuse(*args, **kwargs):
        raise AssertionError("K/V repeated for grouped-query attention")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    torch.testing.assert_close(run(), expected, rtol=1e-5, atol=1e-5)


def test_kv_heads_are_read_in_place_only_where_a_fused_kernel_takes_grouped_queries():
    # FlashAttention on CUDA: 16-bit, no mask; else SDPA's math backend would build [H, q, K]
    assert gqa_in_place("cuda", torch.bfloat16, masked=False) == SDPA_HAS_GQA
    assert gqa_in_place("cuda", torch.float16, masked=False) == SDPA_HAS_GQA
    assert not gqa_in_place("cuda", torch.float32, masked=False)
    assert not gqa_in_place("cuda", torch.bfloat16, masked=True)
    # torch's CPU flash kernel, masked or not, from torch 2.9 on
    assert gqa_in_place("cpu", torch.float32, masked=True) == CPU_FLASH_HAS_GQA
    assert gqa_in_place("cpu", torch.float32, masked=False) == CPU_FLASH_HAS_GQA


def test_a_cached_prefix_is_split_off_only_where_no_window_cuts_it():
    seqs = [SeqSlice(24, 40, list(range(16))), SeqSlice(5, 0, [20, 21])]
    plain = build_attention_metadata(seqs, 4, torch.device("cpu"), None)
    assert [p.num_prefix_keys for p in plain.prefills] == [40, 0]
    windowed = build_attention_metadata(seqs, 4, torch.device("cpu"), 50)
    assert [p.num_prefix_keys for p in windowed.prefills] == [0, 0]  # 64 > 50: the window cuts
