"""Host-to-device staging: the values arrive intact on the CPU path (the CUDA path, pinned memory
and a non-blocking copy, needs a GPU: scripts/gpu_check.py's parity runs go through it)."""

import torch

from kv.host_staging import PinnedStaging, tensor_on, to_device


def test_values_and_dtype_arrive_on_the_host_device():
    t = tensor_on([3, 1, 2], torch.long, "cpu")
    assert t.dtype == torch.long and t.tolist() == [3, 1, 2] and t.device.type == "cpu"
    mask = torch.tensor([[True, False]])
    assert torch.equal(to_device(mask, torch.device("cpu")), mask)
    assert tensor_on([], torch.int32, "cpu").shape == (0,)


def test_pinned_staging_copies_the_rows_it_was_given_from_rotating_buffers():
    staging = PinnedStaging((2, 4), torch.long, "cpu")
    out = torch.full((2, 4), -1, dtype=torch.long)
    staging.copy(([1, 2, 3, 4], [5, 6, 7, 8]), out)
    assert out.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    staging.copy(([9], [10, 11]), out)  # the other buffer: never written past these
    assert out.tolist() == [[9, 0, 0, 0], [10, 11, 0, 0]]
    staging.copy(([12], [13]), out)  # the first buffer again: its older columns stay
    assert out.tolist() == [[12, 2, 3, 4], [13, 6, 7, 8]]
