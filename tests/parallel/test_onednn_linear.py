"""Packed oneDNN linears equal ``F.linear`` (to fp32 rounding), in the layers that use them."""

import pytest
import torch
import torch.nn.functional as F

from parallel.embedding import ParallelLMHead
from parallel.linear import ColumnParallelLinear, RowParallelLinear
from parallel.onednn_linear import PackedWeight, can_pack, pack_linear_weights
from parallel.tp_group import TPGroupConfig, init_tp_group

needs_onednn = pytest.mark.skipif(not can_pack(torch.empty(1, 1)),
                                  reason="oneDNN linears are not available in this torch build")


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 7, 32, 300])
def test_packed_weight_matches_f_linear(num_rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(num_rows, 96), torch.randn(40, 96), torch.randn(40)
    out = PackedWeight(w).linear(x, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert PackedWeight(w).linear(x[:0]).shape == (0, 40)


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
