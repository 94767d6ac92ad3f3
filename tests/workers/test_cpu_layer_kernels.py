"""The bf16 CPU layer kernels (``workers/models/csrc/layer_ops.c``) give the PyTorch expressions'
values bit for bit: add + RMSNorm, SiLU-and-multiply, RoPE with the cache write."""

import pytest
import torch

import workers.models.cpu_layer_kernels as cpu_layer_kernels
from workers.model_config import RopeConfig
from workers.models.layer_ops import CpuBf16LayerOps, TorchLayerOps, layer_ops
from workers.models.rope import RotaryEmbedding

BF16 = torch.bfloat16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops():
    kernels = cpu_layer_kernels.layer_kernels()
    assert kernels is not None, "no C compiler, or the kernels failed their check: see the log"
    return CpuBf16LayerOps(kernels), TorchLayerOps()


def _randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


# 64 x 576: over the threads' threshold; rows of 584: 16-value vectors and a scalar tail
@pytest.mark.parametrize("num_tokens, hidden", [(1, 576), (64, 576), (600, 576), (33, 584)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_equals_the_expressions(ops, num_tokens, hidden, with_residual):
    """Rows with outliers, where a sum of squares in another order than PyTorch's parts."""
    kernel, torch_ops = ops
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(num_tokens, hidden, generator=gen)
         * torch.exp(2 * torch.randn(num_tokens, hidden, generator=gen))).to(BF16)
    weight = _randn(hidden, seed=2).abs() + 0.5
    residual = _randn(num_tokens, hidden, seed=3) if with_residual else None
    got, want = (o.add_rms_norm(x, residual, weight, 1e-5) for o in (kernel, torch_ops))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("num_tokens, width, scale",
                         [(1, 1536, 3.0), (64, 1536, 3.0), (200, 1536, 40.0), (9, 1544, 40.0)])
def test_silu_and_mul_equals_the_expressions(ops, num_tokens, width, scale):
    """Gates far out too (40 sigma: exp over- and underflowing); rows of 1544: a scalar tail."""
    kernel, torch_ops = ops
    gate_up = _randn(num_tokens, 2 * width, seed=4, scale=scale)
    assert torch.equal(kernel.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up))


# heads of 64 and 128: halves of 16-value vectors; of 80: the scalar path
@pytest.mark.parametrize("num_tokens, head_dim", [(1, 64), (48, 64), (30, 128), (7, 80)])
def test_rope_write_kv_equals_the_expressions(ops, num_tokens, head_dim):
    kernel, torch_ops = ops
    rotary = RotaryEmbedding(RopeConfig(theta=100000.0), head_dim, 4096, BF16, CPU)
    gen = torch.Generator().manual_seed(5)
    tables = rotary.tables(torch.randint(0, 4096, (num_tokens,), generator=gen))
    slots = torch.randperm(500, generator=gen)[:num_tokens]
    qkv = _randn(num_tokens, (9 + 2 * 3) * head_dim, seed=6)
    caches = [torch.zeros(500, 3, head_dim, dtype=BF16) for _ in range(4)]
    got = kernel.rope_write_kv(qkv.clone(), tables, caches[0], caches[1], slots, 9, 3)
    want = torch_ops.rope_write_kv(qkv.clone(), tables, caches[2], caches[3], slots, 9, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_a_slot_outside_the_cache_is_an_error_not_a_write(ops):
    kernel, _ = ops
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 64, BF16, CPU)
    cache = torch.zeros(8, 1, 64, dtype=BF16)
    with pytest.raises(IndexError, match="8 slots"):
        kernel.rope_write_kv(_randn(2, 3 * 64), rotary.tables(torch.tensor([0, 1])), cache,
                             cache.clone(), torch.tensor([1, 8]), 1, 1)


def test_bf16_on_cpu_takes_them_and_the_switch_turns_them_off(monkeypatch):
    assert layer_ops(CPU, BF16).name == "cpu-bf16"
    assert layer_ops(CPU, torch.float32).name == "torch"  # fp32: the expressions, exact parity
    monkeypatch.setenv(cpu_layer_kernels.SWITCH_ENV, "0")
    cpu_layer_kernels.layer_kernels.cache_clear()
    try:
        assert layer_ops(CPU, BF16).name == "torch"
    finally:
        cpu_layer_kernels.layer_kernels.cache_clear()


@pytest.mark.parametrize("num_rows, vocab", [(1, 5), (3, 40), (64, 4099), (2, 49159)])
def test_first_max_equals_torch_max_indices(ops, num_rows, vocab):
    """Ties everywhere (a few distinct values), zeros of both signs, NaNs first, in the vector
    part and in the tail: each row's index as ``max(dim=-1)`` gives it."""
    kernel = ops[0]._layer
    gen = torch.Generator().manual_seed(7)
    rows = torch.randint(-3, 4, (num_rows, vocab), generator=gen).to(BF16)
    rows[0, -1] = -0.0
    if num_rows > 1:
        rows[1, [0, vocab // 2, vocab - 1]] = float("nan")
        rows[-1, vocab - 1] = float("nan")  # the scalar tail's
    if num_rows > 2:
        rows[2, :] = -0.0
        rows[2, vocab // 3] = 0.0
    assert torch.equal(kernel.first_max(rows), rows.max(dim=-1).indices)
