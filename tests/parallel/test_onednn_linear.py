"""Packed oneDNN linears equal ``F.linear`` (to fp32 rounding), in the layers that use them."""

import pytest
import torch
import torch.nn.functional as F

from parallel.embedding import ParallelLMHead
from parallel.linear import ColumnParallelLinear, RowParallelLinear
from parallel.onednn_linear import (PackedWeight, can_pack, pack_linear_weights, padded_rows,
                                    warm_up_linears)
from parallel.tp_group import TPGroupConfig, init_tp_group

needs_onednn = pytest.mark.skipif(not can_pack(torch.empty(1, 1)),
                                  reason="oneDNN linears are not available in this torch build")


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 7, 32, 33, 300])  # 33 and 300 run padded
def test_packed_weight_matches_f_linear(num_rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(num_rows, 96), torch.randn(40, 96), torch.randn(40)
    out = PackedWeight(w).linear(x, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert PackedWeight(w).linear(x[:0]).shape == (0, 40)
    batched = PackedWeight(w).linear(x.view(1, num_rows, 96))
    assert batched.shape == (1, num_rows, 40) and batched.is_contiguous()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_calls_owe_nothing_to_the_rows_an_earlier_call_left(dtype):
    """A padded call's extra rows come from a buffer the thread reuses: rows a bigger call left
    there (NaN here) change neither its result nor an earlier call's."""
    torch.manual_seed(0)
    w = torch.randn(40, 96).to(dtype)
    packed = PackedWeight(w)
    packed.linear(torch.full((300, 96), float("nan"), dtype=dtype))  # fills the buffer
    x = torch.randn(33, 96).to(dtype)  # padded to 36 rows: 3 of them the NaN ones
    first = packed.linear(x)
    assert not first.isnan().any()
    torch.testing.assert_close(first, F.linear(x, w), rtol=2e-2 if dtype == torch.bfloat16
                               else 1e-5, atol=1e-1 if dtype == torch.bfloat16 else 1e-4)
    kept = first.clone()
    packed.linear(torch.randn(37, 96).to(dtype))  # the same buffer again
    assert torch.equal(first, kept)  # the result is not a view of the buffer
    assert torch.equal(packed.linear(x), kept)
    strided = torch.randn(96, 33).to(dtype).t()  # not contiguous, padded
    torch.testing.assert_close(packed.linear(strided), packed.linear(strided.contiguous()),
                               rtol=0, atol=0)


def test_row_buckets_are_few_and_pad_less_than_an_eighth():
    assert [padded_rows(n) for n in (1, 31, 32, 33, 36, 37, 64, 65, 300, 2048)] == \
        [1, 31, 32, 36, 36, 40, 64, 72, 320, 2048]
    assert all(n <= padded_rows(n) < n * 9 / 8 for n in range(1, 9000))
    assert all(padded_rows(padded_rows(n)) == padded_rows(n) for n in range(1, 9000))
    assert len({padded_rows(n) for n in range(1, 2049)}) == 80  # 32 exact, 8 per doubling


@needs_onednn
def test_warm_up_runs_each_shape_once_at_every_bucket(monkeypatch):
    """One weight per shape (oneDNN's kernels do not depend on the weight's values)."""
    seen = []
    linear = PackedWeight.linear

    def recording(self, x, bias=None):
        seen.append((self.out_features, x.shape[0]))
        return linear(self, x, bias)

    monkeypatch.setattr(PackedWeight, "linear", recording)
    model = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    for module, shape in zip(model, [(40, 96), (40, 96), (24, 96)]):
        module.packed = PackedWeight(torch.randn(shape))
    assert warm_up_linears(model, 40, torch.float32) == 2 * 34
    buckets = list(range(1, 33)) + [36, 40]
    assert sorted(seen) == sorted((out, n) for out in (24, 40) for n in buckets)


@needs_onednn
def test_layers_multiply_through_their_packed_weight():
    tp = init_tp_group(TPGroupConfig(0, 1, None), torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "col": ColumnParallelLinear(16, [8, 8], True, tp, torch.float32),
        "row": RowParallelLinear(16, 16, False, tp, torch.float32),
        "head": ParallelLMHead(11, 16, tp, torch.float32)})
    for param in model.parameters():
        param.data.normal_()
    x = torch.randn(5, 16)
    dense = model["head"](model["row"](model["col"](x)))
    assert pack_linear_weights(model) == 3
    assert all(m.packed is not None for m in model.values())
    torch.testing.assert_close(model["head"](model["row"](model["col"](x))), dense,
                               rtol=1e-4, atol=1e-3)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TPSERVE_ONEDNN_LINEAR", "0")
    assert not can_pack(torch.empty(4, 4))
    assert not can_pack(torch.empty(4, 4, dtype=torch.float16))


@needs_onednn
def test_a_rank_warms_up_only_models_past_the_threshold(monkeypatch):
    import workers.rank as rank

    calls = []
    monkeypatch.setattr(rank, "warm_up_linears", lambda *args: calls.append(args) or 0)
    module = torch.nn.Module()
    module.packed = PackedWeight(torch.randn(40, 96))  # 15 KiB
    rank.warm_up_cpu_linears(module, 8, torch.float32)
    assert calls == []
    monkeypatch.setattr(rank, "WARM_UP_MIN_BYTES", 1024)
    rank.warm_up_cpu_linears(module, 8, torch.float32)
    assert calls == [(module, 8, torch.float32)]
