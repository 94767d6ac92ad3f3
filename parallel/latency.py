"""A bounded record of operation latencies (e.g. all-reduce), cheap enough for every call."""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict


class LatencyRecorder:
    """Keeps the last ``capacity`` samples and running totals; ``drain`` hands new samples out."""

    def __init__(self, capacity: int = 4096) -> None:
        self.samples: Deque[float] = deque(maxlen=capacity)
        self.count = 0
        self.total_s = 0.0
        self._pending: Deque[float] = deque(maxlen=capacity)

    def record(self, seconds: float) -> None:
        self.samples.append(seconds)
        self._pending.append(seconds)
        self.count += 1
        self.total_s += seconds

    def drain(self) -> list:
        """Samples recorded since the last drain (for exporting to a histogram)."""
        out = list(self._pending)
        self._pending.clear()
        return out

    def summary(self) -> Dict[str, float]:
        ordered = sorted(self.samples)
        if not ordered:
            return {"count": 0, "p50_s": 0.0, "p99_s": 0.0, "mean_s": 0.0}
        return {
            "count": self.count,
            "p50_s": ordered[len(ordered) // 2],
            "p99_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "mean_s": self.total_s / self.count,
        }
