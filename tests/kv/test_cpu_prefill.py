"""The CPU prefill attention kernel (`kv.attention.cpu_prefill`), its products on AMX tiles and on
AVX-512 BF16 (each where the CPU has it): within bf16 rounding of fp32 SDPA, in place in the paged
cache, taken by the torch backend for the prefills whose mask it computes; never built where the
CPU has neither."""

import pytest
import torch

import kv.attention.cpu_prefill as cpu_prefill
import kv.attention.torch_paged as torch_paged
from kv.attention.cpu_prefill import PrefillKernel, build_kernel, prefill_kernel, reference_prefill
from kv.attention.metadata import PrefillSlice, SeqSlice, build_attention_metadata
from kv.native_build import KernelBuildError
from parallel.cpu_capability import cpu_bf16_support

# what this CPU can run: AMX CPUs have AVX-512 BF16 too
RUNNABLE = {"amx": ("amx", "avx512_bf16"), "avx512_bf16": ("avx512_bf16",)}.get(
    cpu_bf16_support().path, ())
needs_kernel = pytest.mark.skipif(not RUNNABLE, reason="the kernel needs AMX or AVX-512 BF16")
each_products = pytest.mark.parametrize("products", [
    pytest.param(products, marks=pytest.mark.skipif(products not in RUNNABLE,
                                                    reason=f"no {products} on this CPU"))
    for products in cpu_prefill.PRODUCTS])
TOLERANCE = 1e-2  # about one bf16 rounding of unit-scale outputs


def _case(rows, prefix, heads, kv_heads, head_dim, seed=0, lead=3):
    gen = torch.Generator().manual_seed(seed)
    num_slots = prefix + rows + 40
    k_cache, v_cache = (torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16()
                        for _ in range(2))
    # q inside a wider row, as it sits in the fused QKV projection's output
    qkv = torch.randn(lead + rows, heads + 2 * kv_heads, head_dim, generator=gen).bfloat16() * 2
    slots = torch.randperm(num_slots, generator=gen)[:prefix + rows]
    return qkv[:, :heads], k_cache, v_cache, PrefillSlice(lead, lead + rows, slots, None, prefix)


@each_products
@pytest.mark.parametrize("rows, prefix, heads, kv_heads, head_dim", [
    (1, 0, 9, 3, 64), (290, 0, 9, 3, 64), (16, 16, 2, 1, 64), (17, 5, 4, 2, 128),
    (100, 37, 8, 8, 64), (33, 100, 32, 8, 128)])
def test_the_kernel_is_within_bf16_rounding_of_sdpa(products, rows, prefix, heads, kv_heads,
                                                    head_dim):
    """Rows and keys that fill the kernel's blocks of 16 and 32 or not, grouped heads, both head
    dims, with and without a cached prefix; the rows around the chunk stay untouched."""
    query, k_cache, v_cache, prefill = _case(rows, prefix, heads, kv_heads, head_dim)
    kernel = build_kernel(products)
    assert kernel.products == products and kernel.accepts(query, k_cache, v_cache)
    out = torch.full((query.shape[0] + 2, heads * head_dim), 7.0, dtype=torch.bfloat16)
    kernel.attend(query, k_cache, v_cache, prefill, head_dim ** -0.5, out)
    want = reference_prefill(query, k_cache, v_cache, prefill, head_dim ** -0.5)
    assert (out[prefill.start:prefill.end].float() - want).abs().max().item() < TOLERANCE
    assert (out[:prefill.start] == 7).all() and (out[prefill.end:] == 7).all()


@each_products
def test_a_slot_outside_the_cache_is_refused_before_anything_is_read(products):
    query, k_cache, v_cache, prefill = _case(20, 4, 4, 2, 64)
    out = torch.zeros(query.shape[0], 4 * 64, dtype=torch.bfloat16)
    for bad in (k_cache.shape[0], -1):
        slots = prefill.kv_slots.clone()
        slots[7] = bad
        wrong = PrefillSlice(prefill.start, prefill.end, slots, None, prefill.num_prefix_keys)
        with pytest.raises(ValueError, match="key slots must lie in the cache's"):
            build_kernel(products).attend(query, k_cache, v_cache, wrong, 0.125, out)
    assert (out == 0).all()


def test_accepts_only_bf16_rows_of_the_head_dims_it_has_tiles_for():
    query, k_cache, v_cache, _ = _case(4, 0, 4, 2, 64)
    assert PrefillKernel.accepts(query, k_cache, v_cache)
    assert not PrefillKernel.accepts(query.float(), k_cache.float(), v_cache.float())
    assert not PrefillKernel.accepts(query[..., :32], k_cache[..., :32].contiguous(),
                                     v_cache[..., :32].contiguous())
    assert not PrefillKernel.accepts(query.transpose(1, 2), k_cache, v_cache)


def test_takes_causal_prefills_with_or_without_a_prefix_but_not_a_window():
    """`build_attention_metadata`'s three kinds of prefill: plain causal, after a cached prefix,
    and cut by a sliding window (left to SDPA)."""
    seqs = [SeqSlice(8, 0, [0, 1]), SeqSlice(4, 12, [2, 3, 4, 5])]
    plain, prefixed = build_attention_metadata(seqs, 4, torch.device("cpu")).prefills
    assert PrefillKernel.takes(plain) and PrefillKernel.takes(prefixed)
    windowed = build_attention_metadata(seqs, 4, torch.device("cpu"), sliding_window=6).prefills
    assert not any(PrefillKernel.takes(p) for p in windowed)


def test_leaves_prefills_past_max_keys_to_sdpa():
    keys = torch.arange(cpu_prefill.MAX_KEYS + 1)
    assert PrefillKernel.takes(PrefillSlice(0, 100, keys[:cpu_prefill.MAX_KEYS], None,
                                            cpu_prefill.MAX_KEYS - 100))
    assert not PrefillKernel.takes(PrefillSlice(0, 100, keys, None, cpu_prefill.MAX_KEYS - 99))


@needs_kernel
def test_paged_attention_sends_the_prefills_it_takes_to_the_kernel(monkeypatch):
    torch.manual_seed(0)
    # a fresh prefill, a decode, a chunk after 30 cached keys
    seqs = [SeqSlice(20, 0, range(0, 5)), SeqSlice(1, 9, range(5, 8)), SeqSlice(6, 30, range(8, 17))]
    k_cache, v_cache = (torch.randn(18 * 4, 2, 64).bfloat16() for _ in range(2))
    query = torch.randn(27, 6, 64).bfloat16()
    kernel, calls = prefill_kernel(), []
    real = kernel.attend
    monkeypatch.setattr(kernel, "attend",
                        lambda *a: (calls.append(a[3].num_prefix_keys), real(*a)))
    meta = build_attention_metadata(seqs, 4, torch.device("cpu"))
    out = torch_paged.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert calls == [0, 30]  # the two prefills, not the decode
    for prefill in meta.prefills:
        want = reference_prefill(query, k_cache, v_cache, prefill, 0.125)
        assert (out[prefill.start:prefill.end].float() - want).abs().max().item() < TOLERANCE


def test_no_kernel_without_bf16_instructions_or_when_switched_off(monkeypatch):
    prefill_kernel.cache_clear()
    try:
        monkeypatch.setenv("TPSERVE_CPU_KERNELS", "0")
        assert prefill_kernel() is None
        prefill_kernel.cache_clear()
        monkeypatch.delenv("TPSERVE_CPU_KERNELS")
        slow = type(cpu_bf16_support())(path=None, flags_known=True, mkldnn_available=True,
                                        onednn_bf16=True, cpu_capability="AVX512")
        monkeypatch.setattr("parallel.cpu_capability.cpu_bf16_support", lambda: slow)
        assert prefill_kernel() is None
    finally:
        prefill_kernel.cache_clear()


@needs_kernel
def test_the_process_kernel_runs_on_the_best_products_the_cpu_has():
    assert prefill_kernel().products == RUNNABLE[0]


def test_unknown_products_are_refused_by_name():
    with pytest.raises(ValueError, match="products must be one of"):
        build_kernel("avx2")


@needs_kernel
def test_check_rejects_a_kernel_that_computes_something_else():
    class Unscaled(PrefillKernel):  # forgets the 1/sqrt(D) of the scores
        def attend(self, query, k_cache, v_cache, prefill, scale, out):
            super().attend(query, k_cache, v_cache, prefill, 1.0, out)

    kernel = prefill_kernel()
    with pytest.raises(KernelBuildError, match="differs from SDPA"):
        cpu_prefill.check(Unscaled(kernel.path))
