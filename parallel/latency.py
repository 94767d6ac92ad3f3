"""Bounded records of operation latencies (e.g. all-reduce), cheap enough for every call.

Host-timed operations are recorded as they finish (``record``). Device-timed ones hand over a
pair of timing events instead (``record_events``): a pair is read only once its end event has
completed (``query()``, never ``synchronize()``), so timing never makes the host wait for the
device. Completed pairs are read lazily, when the next pair comes in and whenever samples are
read out (``drain``, ``summary``).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Dict, List, Protocol, Tuple


class TimingEvent(Protocol):
    """What is used of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: "TimingEvent") -> float: ...  # milliseconds


class LatencyRecorder:
    """Keeps the last ``capacity`` samples and running totals; ``drain`` hands new samples out.

    At most ``max_pending_events`` event pairs wait for their device; beyond that the oldest is
    dropped unread (``num_dropped_events``), so a stalled device costs bounded memory.
    ``record`` is meant for one writer thread; event pairs may be read from any thread.
    """

    def __init__(self, capacity: int = 4096, max_pending_events: int = 128) -> None:
        self.samples: Deque[float] = deque(maxlen=capacity)
        self.count = 0
        self.total_s = 0.0
        self.num_dropped_events = 0
        self._pending: Deque[float] = deque(maxlen=capacity)
        self._events: Deque[Tuple[TimingEvent, TimingEvent]] = deque()
        self._max_pending_events = max_pending_events
        self._events_lock = threading.Lock()

    def record(self, seconds: float) -> None:
        self.samples.append(seconds)
        self._pending.append(seconds)
        self.count += 1
        self.total_s += seconds

    def record_events(self, start: TimingEvent, end: TimingEvent) -> None:
        """Keep a recorded start/end pair (same stream) to read once ``end`` has completed."""
        self.collect()
        with self._events_lock:
            if len(self._events) >= self._max_pending_events:
                self._events.popleft()
                self.num_dropped_events += 1
            self._events.append((start, end))

    @property
    def num_pending_events(self) -> int:
        return len(self._events)

    def collect(self) -> int:
        """Record the pairs whose end event has completed, oldest first; never blocks.

        Pairs complete in the order they were recorded on their stream, so this stops at the
        first one still running. Returns how many were recorded.
        """
        if not self._events:  # the host-timed path never takes the lock
            return 0
        num_read = 0
        with self._events_lock:
            while self._events and self._events[0][1].query():
                start, end = self._events.popleft()
                self.record(start.elapsed_time(end) / 1000.0)
                num_read += 1
        return num_read

    def drain(self) -> List[float]:
        """Samples recorded since the last drain (for exporting to a histogram)."""
        self.collect()
        out = []
        while self._pending:  # popleft, not list + clear: a record() in between is not lost
            out.append(self._pending.popleft())
        return out

    def summary(self) -> Dict[str, float]:
        self.collect()
        ordered = sorted(self.samples)
        if not ordered:
            return {"count": 0, "p50_s": 0.0, "p99_s": 0.0, "mean_s": 0.0}
        return {
            "count": self.count,
            "p50_s": ordered[len(ordered) // 2],
            "p99_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "mean_s": self.total_s / self.count,
        }
