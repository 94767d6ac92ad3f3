"""The tensor-parallel group of one rank: its rank, the world size and two process groups.

- ``cpu_group`` (always gloo) carries control: the per-step plan broadcast from rank 0.
- ``device_group`` carries activations: NCCL on CUDA, gloo on CPU.

All-reduces on the device group are timed (``all_reduce_latency``) so the serving layer can export
their latency, by ``all_reduce_timer`` (`parallel.collective_timer`). On CPU (gloo, synchronous)
each one is timed on the host as it runs. On CUDA one in ``all_reduce_timing_interval`` is timed
by a pair of CUDA events on the current stream, eager or inside a captured CUDA graph (then on
every replay), read once they have completed: the timing never makes the host wait for the GPU.
A sample is then the collective's time on the device, from the stream reaching it (after the work
queued before it) to its end, waiting for the slowest rank included.

Every collective that raises (a peer died, the group timed out) is counted by kind
(``collective_errors``, see `parallel.collective_errors`) before the error goes on up: the
serving layer exports the counts of every rank.

A group of size 1 has no process groups and every collective is a no-op.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Callable, ContextManager, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from parallel.collective_errors import CollectiveErrors
from parallel.collective_timer import CollectiveTimer, EventTimer, HostTimer
from parallel.latency import LatencyRecorder
from parallel.rendezvous import announce, listening_store

logger = logging.getLogger(__name__)


RENDEZVOUS_S = 600.0  # how long the first rank waits for the others to start and join


@dataclass(frozen=True)
class TPGroupConfig:
    """How a rank joins its group: ``init_method`` is a ``tcp://host:port`` that rank 0 listens on;
    ``listen_fd``, rank 0's socket already listening there (a `RendezvousSocket`'s, in rank 0's
    own process), or None for rank 0 to bind the port itself."""

    rank: int
    world_size: int
    init_method: Optional[str] = None
    timeout_s: float = 600.0  # every collective of the group (the engine sets its step timeout)
    all_reduce_timing_interval: int = 64  # on CUDA, time one all-reduce in this many
    listen_fd: Optional[int] = None

    def __post_init__(self) -> None:
        if self.all_reduce_timing_interval < 1:
            raise ValueError("all_reduce_timing_interval (time one all-reduce in every N) must be "
                             f"at least 1, got {self.all_reduce_timing_interval}")
        if self.world_size < 1:
            raise ValueError(f"tensor-parallel size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if self.world_size > 1 and not self.init_method:
            raise ValueError("a group larger than 1 needs an init_method (tcp://host:port)")
        if self.listen_fd is not None and (self.rank != 0 or self.world_size == 1):
            raise ValueError(f"listen_fd is rank 0's socket in a group of 2 or more, not rank "
                             f"{self.rank}'s of {self.world_size}")


@dataclass
class TPGroup:
    """A rank's view of its tensor-parallel group (never ``dist.get_rank()`` as the TP rank)."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: Optional[dist.ProcessGroup] = None
    device_group: Optional[dist.ProcessGroup] = None
    # gloo, waiting up to RENDEZVOUS_S: for startup, when ranks may be minutes apart
    startup_group: Optional[dist.ProcessGroup] = None
    all_reduce_latency: LatencyRecorder = field(default_factory=LatencyRecorder)
    all_reduce_timing_interval: int = 64  # on CUDA, time one all-reduce in this many
    collective_errors: CollectiveErrors = field(default_factory=CollectiveErrors)
    all_reduce_timer: CollectiveTimer = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self.all_reduce_timer = EventTimer(
                self.all_reduce_latency, self.all_reduce_timing_interval, _new_timing_event,
                _is_capturing)
        else:
            self.all_reduce_timer = HostTimer(self.all_reduce_latency)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def wait_for_all_ranks(self) -> None:
        """Return once every rank of the group has got here, waiting up to ``RENDEZVOUS_S``.
        Ranks finish loading their shards (and registering a host tier, creating a disk tier)
        minutes apart on large models; the step collectives that follow wait only a step's
        timeout, so a rank that started them early would give up on the others."""
        if self.startup_group is not None:
            dist.barrier(group=self.startup_group)

    def counting_errors(self, not_collective: Tuple[Type[BaseException], ...] = ()
                        ) -> ContextManager[None]:
        """Around a collective (this group's or one on ``cpu_group``): counts it by kind if it
        raises (``not_collective``: see ``CollectiveErrors.counting``)."""
        return self.collective_errors.counting(not_collective)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (timed); returns it."""
        if self.world_size == 1:
            return tensor
        with self.counting_errors():
            return self._all_reduce(tensor)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        token = self.all_reduce_timer.start()
        dist.all_reduce(tensor, group=self.device_group)
        self.all_reduce_timer.stop(token)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenate every rank's ``tensor`` along the last dim on rank 0; None elsewhere."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts: Optional[List[torch.Tensor]] = None
        if self.is_first:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.counting_errors():
            dist.gather(tensor, parts, dst=dist.get_global_rank(self.device_group, 0),
                        group=self.device_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank, in place over the device group (no host copy on
        CUDA); the other ranks pass a tensor of the same shape and dtype to receive it."""
        if self.world_size == 1:
            return tensor
        with self.counting_errors():
            dist.broadcast(tensor, src=dist.get_global_rank(self.device_group, 0),
                           group=self.device_group)
        return tensor

    def destroy(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _new_timing_event(external: bool) -> torch.cuda.Event:
    """An external event is recorded by a graph node when captured (on every replay)."""
    return torch.cuda.Event(enable_timing=True, external=external)


def _is_capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def init_tp_group(config: TPGroupConfig, device: torch.device,
                  check_peers: Optional[Callable[[], None]] = None) -> TPGroup:
    """Join the group described by ``config`` (blocks until every rank has joined). Rank 0 with
    a ``listen_fd`` calls ``check_peers`` while it waits for the others (see
    `parallel.rendezvous`)."""
    if config.world_size == 1:
        return TPGroup(0, 1, device)  # no collectives, nothing to time
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The rendezvous waits for ranks still starting (a process, its imports): not a step. The
    # groups every collective runs on use ``timeout_s``.
    rendezvous_timeout = max(timeout, timedelta(seconds=RENDEZVOUS_S))
    if config.listen_fd is not None:
        store = listening_store(config.init_method, config.listen_fd, config.world_size,
                                rendezvous_timeout, check_peers)
        dist.init_process_group(backend=backend, store=store, rank=0,
                                world_size=config.world_size, timeout=rendezvous_timeout)
    else:
        if config.rank > 0:
            announce(config.init_method, config.rank, rendezvous_timeout)
        dist.init_process_group(backend=backend, init_method=config.init_method,
                                rank=config.rank, world_size=config.world_size,
                                timeout=rendezvous_timeout)
    ranks = list(range(config.world_size))
    device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    startup_group = dist.new_group(ranks, backend="gloo", timeout=rendezvous_timeout)
    logger.info("rank %d/%d joined (%s device group)", config.rank, config.world_size, backend)
    return TPGroup(config.rank, config.world_size, device, cpu_group, device_group,
                   startup_group, all_reduce_timing_interval=config.all_reduce_timing_interval)

