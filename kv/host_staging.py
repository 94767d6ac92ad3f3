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


class PinnedStaging:
    """Persistent host buffers for a step's small inputs, copied to the device without a sync:
    pinned on CUDA, in ``slots`` rotating buffers, each rewritten only once the copy that last
    read it has finished (an event per slot, which has fired long before in steady state). Saves
    the pinned allocation and the list-to-tensor conversion of ``to_device`` on every step."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: Device,
                 slots: int = 2) -> None:
        self._cuda = torch.device(device).type == "cuda"
        self._buffers = [torch.zeros(tuple(shape), dtype=dtype, pin_memory=self._cuda)
                         for _ in range(slots)]
        self._read: list = [None] * slots  # the event after the copy that last read each slot
        self._turn = 0

    def copy(self, rows: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        """Write ``rows`` into the leading columns of the next buffer's rows (the columns past
        each row keep older values), then copy the whole buffer into ``out`` (on the device, of
        the buffer's shape)."""
        turn = self._turn
        self._turn = (turn + 1) % len(self._buffers)
        if self._read[turn] is not None:
            self._read[turn].synchronize()
        host = self._buffers[turn]
        view = host.numpy()
        for index, row in enumerate(rows):
            view[index, :len(row)] = row
        out.copy_(host, non_blocking=self._cuda)
        if self._cuda:
            self._read[turn] = torch.cuda.Event()
            self._read[turn].record()
