"""Failed collectives of one rank, counted by kind.

- ``error``: a collective raised (a peer closed its connection or died, NCCL reported an error).
- ``timeout``: a collective gave up waiting for a peer (gloo's or NCCL's own timeout).
- ``hang``: the step watchdog declared a step hung (a rank stopped answering; the collective
  it waits in has not timed out yet, and may never, if NCCL's own watchdog ends the process).

One incident may be counted more than once: every rank that sees a collective fail counts it,
and a hang is usually followed by its collective timing out.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterable, Iterator, Mapping, Tuple, Type

ERROR = "error"
TIMEOUT = "timeout"
HANG = "hang"
KINDS = (ERROR, TIMEOUT, HANG)

# What gloo ("Timed out waiting 1500ms for recv operation to complete") and NCCL ("Watchdog
# caught collective operation timeout: WorkNCCL(...) ran for 600000 milliseconds before timing
# out") say when a collective gives up waiting.
_TIMEOUT_WORDS = ("timed out", "timeout", "timing out")


def error_kind(exc: BaseException) -> str:
    """``timeout`` for an exception that says a collective gave up waiting, else ``error``."""
    if isinstance(exc, TimeoutError):
        return TIMEOUT
    message = str(exc).lower()
    return TIMEOUT if any(word in message for word in _TIMEOUT_WORDS) else ERROR


class CollectiveErrors:
    """Counts by kind (every kind present, from 0, so a counter series exists before its first
    failure). Safe to count from several threads (the engine's and the watchdog's)."""

    def __init__(self) -> None:
        self._counts: Dict[str, int] = dict.fromkeys(KINDS, 0)
        self._lock = threading.Lock()

    def count(self, kind: str, n: int = 1) -> None:
        if kind not in self._counts:
            raise ValueError(f"collective error kind {kind!r} is not one of {KINDS}")
        with self._lock:
            self._counts[kind] += n

    @contextlib.contextmanager
    def counting(self, not_collective: Tuple[Type[BaseException], ...] = ()) -> Iterator[None]:
        """Around a collective: counts it by ``error_kind`` if it raises, and re-raises.
        ``not_collective``: exceptions the wrapped code raises before or instead of its
        collective (not counted)."""
        try:
            yield
        except not_collective:
            raise
        except Exception as exc:
            self.count(error_kind(exc))
            raise

    def counts(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self.counts().values())


def sum_counts(reports: Iterable[Mapping[str, int]]) -> Dict[str, int]:
    """Counts by kind summed over ranks (every kind present)."""
    total = dict.fromkeys(KINDS, 0)
    for counts in reports:
        for kind, n in counts.items():
            total[kind] = total.get(kind, 0) + int(n)
    return total
