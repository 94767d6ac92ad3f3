"""Host-to-device staging: the values arrive intact on the CPU path (the CUDA path, pinned memory
and a non-blocking copy, needs a GPU: scripts/gpu_check.py's parity runs go through it)."""

import torch

from kv.host_staging import tensor_on, to_device


def test_values_and_dtype_arrive_on_the_host_device():
    t = tensor_on([3, 1, 2], torch.long, "cpu")
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2] and t.device.type == "cpu"
    mask = torch.tensor([[True, False]])
    assert torch.equal(to_device(mask, torch.device("cpu")), mask)
    assert tensor_on([], torch.int32, "cpu").shape == (0,)
