"""Notices a hung step: a rank that stopped (a frozen process, a GPU fault, a lost node) leaves
rank 0 waiting inside a collective until the group's timeout, with the engine thread alive and
every request in flight silent. The watchdog thread declares the engine hung once the running
step is older than its deadline, ``max(floor_s, factor x the slowest of the recent steps)``, so
the serving layer fails (and migrates) the group's requests and its health check fails.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Callable, Deque, Iterator, Optional

logger = logging.getLogger(__name__)


class StepHungError(RuntimeError):
    """A step ran past its deadline: a rank of the group is hung or gone."""


class StepWatchdog:
    """Times the steps run inside ``step()`` and calls ``on_hung(error)`` (once, from its own
    thread) when one runs past ``deadline_s()``. Costs two clock reads per step."""

    def __init__(self, floor_s: float, on_hung: Callable[[StepHungError], None],
                 factor: float = 10.0, history: int = 64) -> None:
        if floor_s <= 0 or factor <= 0:
            raise ValueError(f"step deadline floor and factor must be positive, got {floor_s} "
                             f"and {factor}")
        self.floor_s, self.factor = floor_s, factor
        self._on_hung = on_hung
        self._recent: Deque[float] = collections.deque(maxlen=history)
        self._started: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tpserve-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def deadline_s(self) -> float:
        return max(self.floor_s, self.factor * max(self._recent, default=0.0))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        started = self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None
            self._recent.append(time.monotonic() - started)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.floor_s / 4)):
            started = self._started
            if started is None:
                continue
            age, deadline = time.monotonic() - started, self.deadline_s()
            if age > deadline:
                error = StepHungError(f"a step has run for {age:.1f} s, past its deadline of "
                                      f"{deadline:.1f} s: a rank is hung or gone")
                logger.error("%s", error)
                self._on_hung(error)
                return
