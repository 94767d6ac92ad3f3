"""Ranks 1..N-1 as local processes (torch.multiprocessing, spawn), for TP without Ray.

Each child builds its rank (joining the process group first), reports ready or the error that
stopped it through a pipe, then serves plans until rank 0 broadcasts a shutdown plan or a
collective fails; then it sends its `RankReport` (its failed collectives) through the same pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, List, Optional, Protocol

import torch
import torch.multiprocessing as mp

from parallel.rendezvous import RendezvousSocket
from workers.rank import RankConfig, RankReport, build_rank, rank_report, serve_plans

logger = logging.getLogger(__name__)

RANK_STOP_S = 30.0  # how long a rank that took the shutdown plan gets to stop before it is killed


class RankHandles(Protocol):
    """Started ranks 1..N-1, however they were launched."""

    def wait_ready(self, timeout_s: float = 600.0) -> None: ...

    def check(self) -> None:
        """Raise what stopped a rank, if one has (does not wait)."""

    def join(self, timeout_s: float = RANK_STOP_S) -> None:
        """Wait ``timeout_s`` for every rank to stop, then kill what is left."""

    def reports(self) -> List[RankReport]:
        """The latest report of each rank that has one, in rank order (does not wait long)."""


RankLauncher = Callable[[List[RankConfig]], RankHandles]


def free_tcp_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` on a port that is free now, for ranks started by hand (tests); an
    IPv6 host goes in brackets. It is closed again: the engine holds its port instead
    (`parallel.rendezvous.RendezvousSocket`)."""
    rendezvous = RendezvousSocket(host)
    rendezvous.close()
    return rendezvous.init_method


def check_local_device(config: RankConfig) -> None:
    """Refuse a rank on a GPU this machine does not show CUDA, before any rank starts: the rank
    would fail in its process while rank 0 waited for it at the rendezvous (``RENDEZVOUS_S``)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:
        world = config.group.world_size
        raise ValueError(
            f"TP {world} runs rank {config.group.rank} on {device}, but CUDA shows this machine "
            f"{count} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): "
            f"ranks on one machine take one GPU each; use --tp {max(count, 1)} or fewer, or "
            f"serve on a Ray cluster (tpserve serve), where a group's ranks span GPUs of several "
            f"machines")


def _rank_main(config: RankConfig, conn) -> None:
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank{config.group.rank} %(name)s: "
                               "%(message)s")
    try:
        rank = build_rank(config)
    except Exception as exc:  # reported to rank 0, which raises it for the user
        conn.send(("error", exc))
        return
    conn.send(("ready", None))
    try:
        serve_plans(rank)
    finally:
        with contextlib.suppress(OSError):  # rank 0's process is gone: nobody to tell
            conn.send(("report", rank_report(rank)))
        rank.tp.destroy()


class RankProcesses:
    """The child ranks of one engine."""

    def __init__(self, configs: List[RankConfig]) -> None:
        for config in configs:
            check_local_device(config)
        ctx = mp.get_context("spawn")
        self._procs, self._conns = [], []
        for config in configs:
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, args=(config, child), daemon=True,
                               name=f"tpserve-rank{config.group.rank}")
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._status: List[Optional[tuple]] = [None] * len(self._procs)  # ("ready"|"error", e)
        self._reports: List[Optional[RankReport]] = [None] * len(self._procs)

    @property
    def pids(self) -> List[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [proc.pid for proc in self._procs]

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every child has loaded; re-raise the first child's error."""
        deadline = time.monotonic() + timeout_s
        for index, proc in enumerate(self._procs):
            while not self._checked(index, wait_s=0.1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s")

    def check(self) -> None:
        for index in range(len(self._procs)):
            self._checked(index, wait_s=0.0)

    def _checked(self, index: int, wait_s: float) -> bool:
        """Whether child ``index`` is ready (its message read, waiting up to ``wait_s``); raises
        its error, or that it exited before it was ready."""
        proc = self._procs[index]
        self._read(index, wait_s if self._status[index] is None else 0.0)
        if self._status[index] is None:
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before it "
                                   f"was ready")
            return False
        status, error = self._status[index]
        if status == "error":
            raise error
        return True

    def _read(self, index: int, wait_s: float) -> None:
        """Take every message child ``index`` has sent, waiting up to ``wait_s`` for the first."""
        conn = self._conns[index]
        try:
            while conn.poll(wait_s):
                kind, payload = conn.recv()
                if kind == "report":
                    self._reports[index] = payload
                else:
                    self._status[index] = (kind, payload)
                wait_s = 0.0
        except (EOFError, OSError):  # the child exited: what it sent has been read
            pass

    def reports(self) -> List[RankReport]:
        for index in range(len(self._procs)):
            self._read(index, 0.0)
        return [report for report in self._reports if report is not None]

    def join(self, timeout_s: float = RANK_STOP_S) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("%s did not stop; terminating it", proc.name)
                proc.terminate()
                proc.join(1)
            if proc.is_alive():  # a stopped (SIGSTOP) process keeps SIGTERM pending
                proc.kill()
                proc.join(5)
