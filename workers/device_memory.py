"""How full a rank's GPU is, for the serving layer's metrics (nothing on CPU).

``used_bytes`` is the device's own figure, ``total - free`` from ``cudaMemGetInfo`` (through
``torch.cuda.mem_get_info``): this rank's tensors and PyTorch's cache, the CUDA context, NCCL's
buffers and any other process on the GPU, the same figure ``nvidia-smi`` reports and the one that
runs out. ``reserved_bytes`` is PyTorch's caching allocator's share of it in this process (the
weights, the KV pool, CUDA graphs' pools). One driver call each: cheap enough once a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class DeviceMemory:
    used_bytes: int
    total_bytes: int
    reserved_bytes: int


def device_memory(device: torch.device) -> Optional[DeviceMemory]:
    """The GPU memory of ``device``; None for a CPU device."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total - free, total, torch.cuda.memory_reserved(device))
