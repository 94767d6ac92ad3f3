"""The host tier of one rank: fixed-size KV slots in one page-aligned allocation.

Slot ``i`` lives at byte ``i * slot_bytes``, where ``slot_bytes`` is the block size rounded up to
4096 bytes, so every slot can go to and from the disk tier with ``O_DIRECT`` unchanged. The whole
buffer is one allocation, so pinning it for asynchronous device copies is one registration.
"""

from __future__ import annotations

import torch

from kv.tiers.disk.store import ALIGNMENT, aligned_buffer


class HostBuffer:
    """Host tier storage of one rank: ``num_slots`` slots, one page-aligned allocation.

    Which slot holds which block is the caller's business. Memory pages are only backed once
    touched. With ``pin=True`` (CUDA only) the whole buffer is registered with the driver once,
    so device copies from and to it can run asynchronously on a copy stream.
    """

    def __init__(self, num_slots: int, block_nbytes: int, pin: bool) -> None:
        if num_slots < 1:
            raise ValueError(f"HostBuffer: num_slots={num_slots}, expected at least 1")
        if block_nbytes < 1:
            raise ValueError(f"HostBuffer: block_nbytes={block_nbytes}, expected at least 1")
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        self.slot_bytes = -(-block_nbytes // ALIGNMENT) * ALIGNMENT
        self._buffer = aligned_buffer(num_slots * self.slot_bytes)
        # Held for the buffer's whole life: an exported mmap cannot be closed (unmapped) under
        # the tensor views below, which do not hold an export themselves.
        self._view = memoryview(self._buffer)
        self.data = torch.frombuffer(self._buffer, dtype=torch.uint8).view(
            num_slots, self.slot_bytes)  # [num_slots, slot_bytes]
        self.is_pinned = False
        if pin:
            self._register()

    def slot(self, index: int) -> torch.Tensor:
        """The block bytes of slot ``index``: a uint8 view ``[block_nbytes]``."""
        return self.data[self._check(index), :self.block_nbytes]

    def view(self, index: int) -> memoryview:
        """All ``slot_bytes`` of slot ``index`` (4096-aligned; what disk I/O moves)."""
        start = self._check(index) * self.slot_bytes
        return self._view[start:start + self.slot_bytes]

    def close(self) -> None:
        """Unregister the buffer from the driver; idempotent.

        The memory itself is returned when the last view of it is dropped, so a view still held
        elsewhere never points at unmapped memory.
        """
        if self.is_pinned:
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr()),
                        "cudaHostUnregister")
            self.is_pinned = False

    def _register(self) -> None:
        nbytes = self.num_slots * self.slot_bytes
        _check_cuda(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0),
                    f"cudaHostRegister of {nbytes} bytes")
        self.is_pinned = True

    def _check(self, index: int) -> int:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"host slot {index} out of range, expected 0 <= slot < "
                             f"{self.num_slots}")
        return index


def _check_cuda(error: object, what: str) -> None:
    code = int(getattr(error, "value", error))
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code} ({error})")
