"""A step's sampled ids on their way to the host, without holding up the thread that launched it.

On CUDA the ids go into one of two persistent pinned buffers by an asynchronous copy, followed by
an event on the stream; ``SampleCopy.wait`` waits for that event alone (no stream or device
synchronization), so the host can launch the next step first and read this one while the device
computes the next. Two buffers are enough because the engine reads a step's ids before it starts
the copy of the step after the next. Logprobs, when asked for, go the same way through pinned
tensors of their own. Elsewhere the samples are on the host already; their ids are copied at
once, since they may view a decode graph's static buffer, which the next step overwrites
(`workers.step_logits`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from workers.sampler import DeviceSamples, SampledToken, read_samples


class SampleCopy:
    """One step's samples being copied to the host."""

    def __init__(self, samples: DeviceSamples, done: Optional[torch.cuda.Event]) -> None:
        self._samples = samples  # host tensors (being filled while ``done`` has not fired)
        self._done = done

    def wait(self) -> List[SampledToken]:
        """The sampled tokens, once the copy has finished (blocks until then)."""
        if self._done is not None:
            self._done.synchronize()
        return read_samples(self._samples)


class SampleCopier:
    """Starts the copy of each step's samples to the host (see the module's docstring)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self._cuda = device.type == "cuda"
        self._buffers: List[torch.Tensor] = []
        self._turn = 0
        if self._cuda:
            self._grow(max_rows)

    def start(self, samples: DeviceSamples) -> SampleCopy:
        """Queue the copy of ``samples`` behind the work that computes them."""
        if not self._cuda:
            return SampleCopy(dataclasses.replace(samples, tokens=samples.tokens.clone()), None)
        rows = samples.tokens.numel()
        if rows > self._buffers[0].numel():
            self._grow(rows)  # copies in flight keep their old buffer alive
        buffer = self._buffers[self._turn][:rows]
        self._turn ^= 1
        buffer.copy_(samples.tokens, non_blocking=True)
        host = samples.map(lambda t: buffer if t is samples.tokens else _pinned_copy(t))
        done = torch.cuda.Event()
        done.record()
        return SampleCopy(host, done)

    def _grow(self, rows: int) -> None:
        self._buffers = [torch.empty(rows, dtype=torch.long, pin_memory=True) for _ in range(2)]


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
