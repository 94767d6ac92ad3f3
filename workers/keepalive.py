"""Keeps ranks 1..N-1 of an idle group from timing out.

Ranks 1..N-1 wait for rank 0's next plan inside a broadcast on the group's CPU process group,
and every collective there fails after the group's timeout (``EngineConfig.step_timeout_s``,
which is also how long a hung rank may stall a step). An engine with nothing to do sends no plan,
so without this its ranks would give up after that long idle. ``PlanKeepalive`` sends an empty
plan from a daemon thread whenever no plan went out for ``interval_s`` and rank 0 is not inside
a step (``lock``, which the engine holds around each step and around its own broadcasts).

An empty plan is safe whenever no tier transfer is outstanding (``can_send``): the ranks' own
transfer agreement is a collective that only plans with outstanding transfers trigger.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


class PlanKeepalive:
    """``send()`` every ``interval_s`` of silence, from a daemon thread, under ``lock``."""

    def __init__(self, send: Callable[[], None], can_send: Callable[[], bool],
                 interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"keepalive interval must be positive, got {interval_s}")
        self.lock = threading.Lock()
        self.interval_s = interval_s
        self.num_sent = 0
        self._send, self._can_send = send, can_send
        self._last_sent = 0.0  # the first idle moment sends at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpserve-plan-keepalive",
                                        daemon=True)
        self._thread.start()

    def sent(self) -> None:
        """A plan went out (call under ``lock``)."""
        self._last_sent = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.interval_s / 4)):
            if time.monotonic() - self._last_sent < self.interval_s:
                continue
            if not self.lock.acquire(blocking=False):
                continue  # a step is running: it broadcasts its own plan
            try:
                if not self._stop.is_set() and self._can_send():
                    self._send()
                    self.num_sent += 1
                    self.sent()
            except Exception:  # noqa: BLE001 - a failed collective is the next step's to report
                logger.exception("keepalive plan failed; stopping keepalives")
                return
            finally:
                self.lock.release()
