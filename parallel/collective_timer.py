"""Timing a TP group's collectives: the same call sites on every device, one timer per device.

    token = timer.start(); <collective>; timer.stop(token)    around every all-reduce
    with timer.capturing() as timings: <capture a graph>      the graph's own timed calls
    with timings.replaying(): graph.replay()                  every replay of that graph

- ``HostTimer`` (CPU, gloo: a collective is done when it returns): every call, by
  ``time.perf_counter``. Nothing is captured on CPU: what stands in for a graph replay there
  runs its forward eagerly, and each collective in it is timed as it runs.
- ``EventTimer`` (CUDA): a sample of calls, each by a pair of CUDA events on the current stream
  around the collective alone, read once completed (``query()``, never a host sync; see
  `parallel.latency`). Eager calls: one in ``every``. Inside a graph capture the first collective
  and then one in ``every`` are timed by *external* events, which the graph records again on
  every replay; ``GraphTimings.replaying`` reads the previous replay's pairs (if they have
  completed; else they are dropped and counted) before the next replay records them again.

Cost per timed call: two event records on the stream, and on the host a query and an elapsed
time read later; an untimed call costs a counter.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Iterator, List, Optional, Protocol, Tuple

from parallel.latency import LatencyRecorder, TimingEvent


class GraphTimings:
    """The event pairs captured inside one CUDA graph (none on CPU); each replay records them
    again. Used from the thread that replays the graph."""

    def __init__(self, recorder: LatencyRecorder) -> None:
        self.recorder = recorder
        self.pairs: List[Tuple[TimingEvent, TimingEvent]] = []
        self._is_pending = False  # a replay recorded the pairs and they have not been read

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Around ``graph.replay()``: first reads what the previous replay recorded."""
        self._read_previous()
        yield
        self._is_pending = bool(self.pairs)

    def _read_previous(self) -> None:
        if not self._is_pending:
            return
        self._is_pending = False
        if all(end.query() for _, end in self.pairs):
            for start, end in self.pairs:
                self.recorder.record(start.elapsed_time(end) / 1000.0)
        else:  # still running: the next replay would record over them
            self.recorder.num_dropped_events += len(self.pairs)


class CollectiveTimer(Protocol):
    recorder: LatencyRecorder

    def start(self) -> object: ...

    def stop(self, token: object) -> None: ...

    def capturing(self) -> ContextManager[GraphTimings]: ...


class HostTimer:
    """Every call timed on the host (a collective that is done when it returns)."""

    def __init__(self, recorder: LatencyRecorder) -> None:
        self.recorder = recorder

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, token: object) -> None:
        assert isinstance(token, float)
        self.recorder.record(time.perf_counter() - token)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[GraphTimings]:
        yield GraphTimings(self.recorder)


class EventTimer:
    """Device timing by event pairs (see the module docstring). ``new_event(external)`` makes
    a timing event (``torch.cuda.Event(enable_timing=True, external=external)``);
    ``is_capturing()`` says whether the current stream is being captured."""

    def __init__(self, recorder: LatencyRecorder, every: int,
                 new_event: Callable[[bool], TimingEvent],
                 is_capturing: Callable[[], bool]) -> None:
        if every < 1:
            raise ValueError(f"time one call in every N calls needs N >= 1, got {every}")
        self.recorder = recorder
        self.every = every
        self._new_event = new_event
        self._is_capturing = is_capturing
        self._num_calls = 0
        self._capture: Optional[GraphTimings] = None
        self._num_capture_calls = 0

    def start(self) -> Optional[TimingEvent]:
        if self._is_capturing():
            if self._capture is None:  # a capture this timer was not told of: no events
                return None
            is_sampled = self._num_capture_calls % self.every == 0
            self._num_capture_calls += 1
        else:
            is_sampled = self._num_calls % self.every == 0
            self._num_calls += 1
        if not is_sampled:
            return None
        event = self._new_event(self._capture is not None)
        event.record()
        return event

    def stop(self, token: object) -> None:
        if token is None:
            return
        end = self._new_event(self._capture is not None)
        end.record()
        if self._capture is not None:
            self._capture.pairs.append((token, end))  # type: ignore[arg-type]
        else:
            self.recorder.record_events(token, end)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capturing(self) -> Iterator[GraphTimings]:
        """Around a graph capture: the collectives captured in it are timed on its replays."""
        timings = GraphTimings(self.recorder)
        self._capture, self._num_capture_calls = timings, 0
        try:
            yield timings
        finally:
            self._capture = None
