"""The bf16 linear kernel (`workers.models.bf16_linear`, AVX-512 BF16): within bf16 rounding of
an fp32 product over panels and row passes full or not, a row's result independent of the other
rows and the thread count; the weights it refuses; which CPUs' bf16 linears take it."""

import pytest
import torch

import workers.models.bf16_linear as bf16_linear
import parallel.cpu_capability as cpu_capability
from workers.models.bf16_linear import KernelWeight, build_kernel, pack, pack_cpu_weight
from parallel.cpu_capability import CpuBf16Support, cpu_bf16_support
from parallel.onednn_linear import PackedWeight

# AMX CPUs have AVX-512 BF16 too: the kernel runs on both, their linears take it on the second
needs_kernel = pytest.mark.skipif(cpu_bf16_support().path not in ("amx", "avx512_bf16"),
                                  reason="the kernel needs AVX-512 BF16")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs() / want.abs().clamp_min(1.0)).max().item()


@needs_kernel
@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 32, 64), (7, 40, 96), (8, 64, 2), (9, 70, 96), (17, 96, 576), (64, 33, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_within_bf16_rounding_of_an_fp32_product(rows, out_features, in_features,
                                                                with_bias):
    """Row counts that fill passes of 8 or not, outputs that fill panels of 32 or not; rows read
    from a wider tensor (a stride past ``in``)."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    wide = torch.randn(rows, in_features + 6, generator=gen).bfloat16()
    x = wide[:, 3:3 + in_features]
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    want = x.float() @ weight.float().T + (bias.float() if with_bias else 0)
    got = build_kernel().linear(x, pack(weight), out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    assert _relative_error(got, want) <= 2 ** -8  # one bf16 rounding


@needs_kernel
def test_a_rows_result_depends_on_that_row_alone():
    """Bitwise equal alone, among 20 other rows, and on 1 or 2 threads."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 576, generator=gen).bfloat16()
    x = torch.randn(21, 576, generator=gen).bfloat16()
    packed, kernel = pack(weight), build_kernel()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = kernel.linear(x, packed, 200)
        alone = torch.cat([kernel.linear(x[i:i + 1], packed, 200) for i in range(21)])
        torch.set_num_threads(2)
        two_threads = kernel.linear(x, packed, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, two_threads)


@needs_kernel
def test_kernel_weight_keeps_the_leading_dims_and_warms_up():
    weight = torch.randn(48, 64).bfloat16()
    packed = KernelWeight(weight, build_kernel())
    x = torch.randn(2, 3, 64).bfloat16()
    out = packed.linear(x)
    assert out.shape == (2, 3, 48)
    assert _relative_error(out, x.float() @ weight.float().T) <= 2 ** -8
    assert packed.warm_up(16, torch.bfloat16) == 1


@needs_kernel
def test_rows_of_another_dtype_are_refused_by_name():
    weight = torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match="takes 2-d bf16 rows, got torch.float32"):
        build_kernel().linear(torch.randn(3, 64), pack(weight), 32)
    assert build_kernel().linear(torch.zeros(0, 64).bfloat16(), pack(weight), 32).shape == (0, 32)


def test_weights_the_kernel_does_not_take():
    assert not bf16_linear.accepts(torch.zeros(32, 63, dtype=torch.bfloat16))  # odd input size
    assert not bf16_linear.accepts(torch.zeros(32, 64))  # fp32
    assert bf16_linear.accepts(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even input size, got 63"):
        pack(torch.zeros(32, 63, dtype=torch.bfloat16))


@pytest.fixture
def cpu_path(monkeypatch):
    """Sets the bf16 path `linear_kernel` sees; its cache cleared before and after."""
    def set_path(path):
        support = CpuBf16Support(path, True, True, True, "AVX512")
        monkeypatch.setattr(cpu_capability, "cpu_bf16_support", lambda: support)
        bf16_linear.linear_kernel.cache_clear()
    yield set_path
    bf16_linear.linear_kernel.cache_clear()


@needs_kernel
def test_bf16_linears_take_the_kernel_on_avx512_bf16_alone(cpu_path, monkeypatch):
    weight = torch.randn(64, 96).bfloat16()
    cpu_path("avx512_bf16")
    assert isinstance(pack_cpu_weight(weight), KernelWeight)
    assert isinstance(pack_cpu_weight(weight.float()), PackedWeight)  # fp32 keeps oneDNN
    assert isinstance(pack_cpu_weight(weight[:, :95].contiguous()), PackedWeight)  # odd input
    cpu_path("amx")
    assert isinstance(pack_cpu_weight(weight), PackedWeight)
    cpu_path("avx512_bf16")
    monkeypatch.setenv("TPSERVE_CPU_KERNELS", "0")
    assert isinstance(pack_cpu_weight(weight), PackedWeight)


@needs_kernel
def test_a_bf16_cpu_rank_packs_its_linears_with_the_kernel_where_the_cpu_takes_it(tiny_llama):
    from parallel.onednn_linear import packed_weights
    from workers.config import EngineConfig
    from workers.llm import LLM

    with LLM(EngineConfig(model=str(tiny_llama), dtype="bfloat16")) as llm:
        packed = packed_weights(llm.engine.rank.runner.model)
    takes_it = bf16_linear.linear_kernel() is not None
    assert packed and all(isinstance(p, KernelWeight) == takes_it for p in packed)
