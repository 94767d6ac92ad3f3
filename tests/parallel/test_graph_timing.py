"""All-reduces captured in a CUDA graph are timed on its replays (``EventTimer.capturing``,
``GraphTimings.replaying``), read one replay later and never with a host sync; on CPU the same
call sites are timed on the host.

As in test_tp_group_timing.py, CUDA is driven by ``FakeDevice`` (no GPU here): a graph's event
record nodes are stood in for by recording the captured events again at each "replay"."""

from __future__ import annotations

import pytest
import torch

from parallel.collective_timer import HostTimer
from parallel.latency import LatencyRecorder
from parallel.tp_group import TPGroup
from test_tp_group_timing import CUDA_TENSOR, cuda_group, fake_cuda  # noqa: F401 - fixture


@pytest.fixture
def capture(fake_cuda, monkeypatch):  # noqa: F811 - the fixture above
    """``capture(tp, n)``: capture a graph of ``n`` all-reduces; returns its timings."""
    state = {"capturing": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])

    def run(tp: TPGroup, num_all_reduces: int):
        with tp.all_reduce_timer.capturing() as timings:
            state["capturing"] = True
            for _ in range(num_all_reduces):
                tp.all_reduce(CUDA_TENSOR)
            state["capturing"] = False
        return timings

    return run


def replay(timings) -> None:
    """A replay: the graph records its captured events again, in order."""
    with timings.replaying():
        for start, end in timings.pairs:
            start.record()
            end.record()


def test_a_captured_graph_times_its_first_all_reduce_and_one_in_interval(fake_cuda, capture):
    tp = cuda_group(all_reduce_timing_interval=4)
    timings = capture(tp, 10)  # calls 0, 4 and 8 of the capture are timed
    assert len(timings.pairs) == 3 and fake_cuda.num_events == 6
    assert all(event.external for pair in timings.pairs for event in pair)  # graph nodes
    assert tp.all_reduce_latency.num_pending_events == 0  # the graph's, not the recorder's
    assert len(capture(cuda_group(all_reduce_timing_interval=64), 5).pairs) == 1


def test_each_replay_is_read_at_the_next_once_complete_never_by_a_host_sync(fake_cuda, capture):
    tp = cuda_group(all_reduce_timing_interval=4)
    timings = capture(tp, 10)
    replay(timings)
    assert tp.all_reduce_latency.drain() == []  # not read before the next replay
    fake_cuda.complete_all()
    replay(timings)  # reads the first replay's three pairs, then records them again
    assert tp.all_reduce_latency.drain() == [pytest.approx(0.0015)] * 3
    replay(timings)  # the second replay has not completed: its pairs are dropped, not waited on
    assert tp.all_reduce_latency.drain() == []
    assert tp.all_reduce_latency.num_dropped_events == 3
    fake_cuda.complete_all()
    replay(timings)
    assert len(tp.all_reduce_latency.drain()) == 3


def test_eager_all_reduces_keep_their_own_count_around_captures(fake_cuda, capture):
    tp = cuda_group(all_reduce_timing_interval=2)
    tp.all_reduce(CUDA_TENSOR)  # eager call 0: timed
    capture(tp, 3)
    tp.all_reduce(CUDA_TENSOR)  # eager call 1: not timed
    assert tp.all_reduce_latency.num_pending_events == 1


def test_the_host_timer_times_the_same_call_sites_inline():
    timer = HostTimer(LatencyRecorder())
    with timer.capturing() as timings:  # nothing is captured on CPU
        timer.stop(timer.start())
    with timings.replaying():  # what stands in for a replay runs eagerly, timed inline
        timer.stop(timer.start())
    assert timings.pairs == [] and len(timer.recorder.drain()) == 2
