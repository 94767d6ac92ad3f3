"""The decoder layer's Triton kernels (the CUDA path) against the PyTorch expressions they replace
(`TorchLayerOps`, the CPU path), run on CPU under Triton's interpreter: residual add + RMSNorm,
SiLU-and-multiply, and RoPE of q and k fused with the paged K/V cache write.

The kernels round where the expressions round, so in fp32 and fp16 the residual sum and RoPE
(the cache write included) equal them bit for bit; RMSNorm differs by the order of its sum of
squares (fp32 1e-5, fp16 one ulp of the rounded row) and SiLU by the last bit of ``exp``.
bfloat16 is checked within two of its ulps: Triton's interpreter truncates fp32 -> bf16 casts
where a GPU rounds to nearest (``_convert_float``), so on CPU every rounding step may sit one ulp
low; ``scripts/gpu_check.py`` measures the compiled kernels' bf16 error on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's @jit decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from workers.models.layer_ops import TorchLayerOps, TritonLayerOps, layer_ops  # noqa: E402
from workers.models.rope import RotaryEmbedding  # noqa: E402
from workers.model_config import RopeConfig  # noqa: E402

CPU = torch.device("cpu")
TORCH, TRITON = TorchLayerOps(), TritonLayerOps()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXACT = (torch.float32, torch.float16)  # dtypes the interpreter rounds as a GPU does
BF16 = dict(rtol=2 ** -6, atol=2 ** -5)  # two ulps: the interpreter truncates bf16 casts
NORM_TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
                  torch.float16: dict(atol=2 ** -9, rtol=2 ** -9), torch.bfloat16: BF16}
SILU_TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-6),
                  torch.float16: dict(atol=2 ** -14, rtol=2 ** -10), torch.bfloat16: BF16}


def assert_matches(got, want, dtype, name=""):
    """Bit for bit in the dtypes the interpreter rounds as a GPU does, else within ``BF16``;
    NaN where ``want`` has NaN."""
    if dtype in EXACT:
        assert torch.allclose(got, want, rtol=0, atol=0, equal_nan=True), name
    else:
        torch.testing.assert_close(got, want, equal_nan=True, **BF16, msg=name)
SETTINGS = settings(max_examples=6, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@given(tokens=st.integers(1, 9), hidden=st.sampled_from([8, 64, 96, 200]),
       seed=st.integers(0, 2 ** 16))
@SETTINGS
def test_add_rms_norm_equals_the_expression(dtype, with_residual, tokens, hidden, seed):
    x = randn(tokens, hidden, dtype=dtype, seed=seed, scale=3.0)
    residual = randn(tokens, hidden, dtype=dtype, seed=seed + 1) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=seed + 2)
    x_before = x.clone()
    out, summed = TRITON.add_rms_norm(x, residual, weight, 1e-5)
    want_out, want_sum = TORCH.add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(summed, want_sum, dtype)  # the residual sum rounds as x + residual does
    torch.testing.assert_close(out, want_out, **NORM_TOLERANCE[dtype])
    assert torch.equal(x, x_before)  # the inputs are left as they were


@pytest.mark.parametrize("dtype", DTYPES)
@given(tokens=st.integers(1, 5), size=st.sampled_from([4, 48, 96, 1500]),
       seed=st.integers(0, 2 ** 16))
@SETTINGS
def test_silu_and_mul_equals_the_expression(dtype, tokens, size, seed):
    gate_up = randn(tokens, 2 * size, dtype=dtype, seed=seed, scale=4.0)
    torch.testing.assert_close(TRITON.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up),
                               **SILU_TOLERANCE[dtype])


def rope_case(tokens, heads, kv_heads, head_dim, dtype, block_size, seed):
    """A packed qkv, the tables of positions around block edges, caches of NaN and scattered
    slots (one token per slot, at the first and last slot of blocks among them)."""
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 512, dtype, CPU)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    num_blocks = tokens + 2
    k_cache = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    blocks = torch.randperm(num_blocks, generator=gen)[:tokens]
    edge = torch.where(torch.arange(tokens) % 2 == 0, 0, block_size - 1)  # a block's edges
    slots = blocks * block_size + edge
    return qkv, rotary.tables(positions), k_cache, k_cache.clone(), slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1), (7, 7)])
@given(tokens=st.integers(1, 6), head_dim=st.sampled_from([8, 32, 96]),
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2 ** 16))
@SETTINGS
def test_rope_and_cache_write_equal_the_expressions(dtype, heads, kv_heads, tokens, head_dim,
                                                    block_size, seed):
    qkv, tables, k_cache, v_cache, slots = rope_case(tokens, heads, kv_heads, head_dim, dtype,
                                                     block_size, seed)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want = TORCH.rope_write_kv(qkv.clone(), tables, want_k_cache, want_v_cache, slots, heads,
                               kv_heads)
    fused_qkv = qkv.clone()
    got = TRITON.rope_write_kv(fused_qkv, tables, k_cache, v_cache, slots, heads, kv_heads)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, name
        assert_matches(g, w, dtype, name)
    # in place: q and k rotated inside the packed buffer, v untouched there
    assert got[0].data_ptr() == fused_qkv.data_ptr()
    assert torch.equal(fused_qkv[:, (heads + kv_heads) * head_dim:],
                       qkv[:, (heads + kv_heads) * head_dim:])
    # the written slots equal, every other slot still NaN on both sides
    assert_matches(k_cache, want_k_cache, dtype, "k_cache")
    assert torch.allclose(v_cache, want_v_cache, rtol=0, atol=0, equal_nan=True)
    assert not k_cache[slots].isnan().any() and k_cache.isnan().sum() == want_k_cache.isnan().sum()


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="gate_up: expected an even number"):
        TRITON.silu_and_mul(torch.zeros(2, 5))
    qkv, tables, k_cache, v_cache, slots = rope_case(3, 4, 2, 8, torch.float32, 4, 0)
    with pytest.raises(ValueError, match=r"qkv: expected \[tokens, \(4 \+ 2 \* 1\) \* 8\]"):
        TRITON.rope_write_kv(qkv, tables, k_cache, v_cache, slots, 4, 1)
    with pytest.raises(ValueError, match="x: expected a .tokens, features. tensor"):
        TRITON.add_rms_norm(torch.zeros(2, 8).t(), None, torch.ones(2), 1e-5)


def test_the_choice_is_made_by_device_and_can_be_forced():
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert layer_ops(CPU, bf16).name == "cpu-bf16"  # the C kernels (they compile here)
    assert layer_ops(CPU, bf16, fused=False).name == "torch"
    assert layer_ops(CPU, torch.float32).name == "torch"  # exact parity with transformers
    assert layer_ops(CPU, torch.float32, fused=True).name == "triton"
    assert layer_ops(cuda, bf16, fused=False).name == "torch"
    assert layer_ops(cuda, bf16).name == "triton"  # triton imports here
    assert layer_ops(cuda, torch.float16).name == "triton"
    assert layer_ops(cuda, torch.float32).name == "torch"  # exact parity with transformers
