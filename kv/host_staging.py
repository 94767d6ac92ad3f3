"""Small per-step tensors built on the host and sent to the device without a host sync.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, which makes the host
wait until the stream has caught up: the CPU could then never prepare step N+1 while the GPU runs
step N. On CUDA these helpers stage the values in pinned memory (PyTorch's caching host allocator
keeps the buffer until the copy is done) and copy with ``non_blocking=True``; elsewhere they are
plain tensors on the device.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

Device = Union[torch.device, str]


def to_device(tensor: torch.Tensor, device: Device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, without a host sync on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_on(values: Sequence, dtype: torch.dtype, device: Device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without a host sync on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), device)
