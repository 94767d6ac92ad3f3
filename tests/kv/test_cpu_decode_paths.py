"""The CPU decode kernel's AVX-512 path equals its portable path, and its in-place call on a flat
batch (`DecodeKernel.attend_rows`) equals `attend` on the gathered rows."""

import pytest
import torch

from kv.attention.cpu_decode import decode_kernel, reference_attend

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}  # bf16: one rounding of the output


def _inputs(dtype, num_seqs=3, num_kv_heads=2, group=3, head_dim=64, num_keys=700, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2048
    k_cache, v_cache = (torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    q = torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=gen).to(dtype)
    slots = torch.randint(0, num_slots, (num_seqs, num_keys), generator=gen)
    valid = torch.rand(num_seqs, num_keys, generator=gen) < 0.7
    valid[:, 0] = True
    return q, k_cache, v_cache, slots, valid, head_dim ** -0.5


@pytest.fixture
def kernel():
    kernel = decode_kernel()
    assert kernel is not None
    yield kernel
    kernel.allow_avx512(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, num_keys, group", [(64, 700, 3), (128, 40, 3), (96, 17, 3),
                                                       (40, 100, 3), (64, 50, 9), (32, 33, 16)])
def test_the_avx512_path_equals_the_portable_one(kernel, dtype, head_dim, num_keys, group):
    """Head sizes it takes (multiples of 32) and one it leaves to the portable path (40); key
    counts across its groups of 16 and the kernel's parts of 512; query heads per KV head in one
    block of register sums or several, the last one partly filled."""
    inputs = _inputs(dtype, head_dim=head_dim, num_keys=num_keys, group=group)
    assert kernel.allow_avx512(False) is True  # the default
    portable = kernel.attend(*inputs).float()
    kernel.allow_avx512(True)
    fast = kernel.attend(*inputs).float()
    q, k, v, slots, valid, scale = inputs
    want = reference_attend(q.float(), k.float(), v.float(), slots, valid, scale)
    assert (fast - want).abs().max().item() < TOLERANCE[dtype]
    assert (fast - portable).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_reads_and_writes_the_batch_in_place(kernel, dtype):
    q, k_cache, v_cache, slots, valid, scale = _inputs(dtype)
    num_seqs, num_kv_heads, group, head_dim = q.shape
    heads = num_kv_heads * group
    # a flat batch of 7 tokens whose rows 5, 0, 3 are the decodes, each token's q heads followed
    # by other columns (as q sits in the fused QKV projection's output)
    qkv = torch.randn(7, heads + 4, head_dim).to(dtype)
    rows = torch.tensor([5, 0, 3])
    qkv[rows, :heads] = q.reshape(num_seqs, heads, head_dim)
    out = torch.full((7, heads * head_dim), 7.0, dtype=dtype)
    kernel.attend_rows(qkv[:, :heads], rows, k_cache, v_cache, slots, valid, scale, out)
    want = kernel.attend(q, k_cache, v_cache, slots, valid, scale).reshape(num_seqs, -1)
    assert torch.equal(out[rows], want)
    untouched = torch.ones(7, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all())


def test_a_row_outside_the_batch_is_an_error(kernel):
    q, k_cache, v_cache, slots, valid, scale = _inputs(torch.bfloat16)
    out = torch.empty(4, q[0].numel(), dtype=torch.bfloat16)
    query = q.reshape(3, -1, q.shape[-1])
    with pytest.raises(IndexError, match="rows"):
        kernel.attend_rows(query, torch.tensor([0, 1, 4]), k_cache, v_cache, slots, valid,
                           scale, out)
