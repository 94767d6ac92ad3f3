"""All-reduce timing: CUDA events read once complete (no host sync in a step); gloo timed inline.

CUDA events cannot exist on this machine (no GPU, CPU-only torch), so the CUDA path is driven
with ``FakeEvent``: it has the ``record``/``query``/``elapsed_time`` of
``torch.cuda.Event(enable_timing=True)``, completes only when the test says the fake device got
there, and raises on ``synchronize``. This checks the logic (sampling, deferred reads, bounds,
no blocking call), not CUDA itself; that is checked on a GPU machine.
"""

from __future__ import annotations

from types import SimpleNamespace

import time

import pytest
import torch
import torch.distributed as dist

from parallel.collective_timer import EventTimer
from parallel.latency import LatencyRecorder
from parallel.tp_group import TPGroup, TPGroupConfig, init_tp_group
from two_ranks import run_two_ranks


class FakeDevice:
    """A stream whose events complete when ``complete_all`` says so; 1.5 ms between events."""

    def __init__(self) -> None:
        self.num_recorded = 0
        self.num_completed = 0
        self.num_events = 0

    def event(self, enable_timing: bool = False, external: bool = False) -> "FakeEvent":
        assert enable_timing, "timing events need enable_timing=True"
        self.num_events += 1
        return FakeEvent(self, external)

    def complete_all(self) -> None:
        self.num_completed = self.num_recorded


class FakeEvent:
    def __init__(self, device: FakeDevice, external: bool = False) -> None:
        self.device = device
        self.external = external
        self.seq = None

    def record(self, stream=None) -> None:
        self.device.num_recorded += 1
        self.seq = self.device.num_recorded

    def query(self) -> bool:
        return self.seq is not None and self.seq <= self.device.num_completed

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an event that has not completed")
        return 1.5 * (end.seq - self.seq)  # milliseconds, as CUDA reports them

    def synchronize(self) -> None:
        raise AssertionError("host sync: Event.synchronize")


def _forbid_host_sync(*args, **kwargs):
    raise AssertionError("host sync inside a step")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA events from a FakeDevice, every host sync raising, all-reduce a counted no-op."""
    device = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.event)
    monkeypatch.setattr(torch.cuda, "synchronize", _forbid_host_sync)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", _forbid_host_sync)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(synchronize=_forbid_host_sync))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    device.num_all_reduces = 0

    def all_reduce(tensor, op=None, group=None, async_op=False):
        device.num_all_reduces += 1

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return device


def cuda_group(**kwargs) -> TPGroup:
    return TPGroup(0, 2, torch.device("cuda"), **kwargs)


CUDA_TENSOR = SimpleNamespace(is_cuda=True)  # dist.all_reduce is faked: it only needs the flag


def test_cuda_all_reduce_makes_no_host_sync(fake_cuda):
    tp = cuda_group()
    for _ in range(3):
        assert tp.all_reduce(CUDA_TENSOR) is CUDA_TENSOR
    assert fake_cuda.num_all_reduces == 3
    assert tp.all_reduce_latency.drain() == []  # nothing read before the events complete
    fake_cuda.complete_all()
    assert tp.all_reduce_latency.drain() == [pytest.approx(0.0015)]  # one sampled, read now


def test_cuda_times_one_all_reduce_in_interval_and_creates_events_only_for_those(fake_cuda):
    tp = cuda_group(all_reduce_timing_interval=4)
    for _ in range(10):  # calls 0, 4 and 8 are timed
        tp.all_reduce(CUDA_TENSOR)
    assert fake_cuda.num_events == 6  # a start and an end event per timed call, none otherwise
    assert tp.all_reduce_latency.num_pending_events == 3
    fake_cuda.complete_all()
    assert tp.all_reduce_latency.drain() == [pytest.approx(0.0015)] * 3
    assert tp.all_reduce_latency.count == 3


def test_cuda_timings_are_read_once_complete_in_order_and_never_twice(fake_cuda):
    tp = cuda_group(all_reduce_timing_interval=1)
    tp.all_reduce(CUDA_TENSOR)
    tp.all_reduce(CUDA_TENSOR)
    fake_cuda.num_completed = 2  # the first pair has completed, the second is still running
    assert tp.all_reduce_latency.drain() == [pytest.approx(0.0015)]
    assert tp.all_reduce_latency.num_pending_events == 1
    assert tp.all_reduce_latency.drain() == []
    fake_cuda.complete_all()
    assert tp.all_reduce_latency.drain() == [pytest.approx(0.0015)]
    assert tp.all_reduce_latency.drain() == []


def test_completed_timings_are_read_lazily_at_the_next_timed_all_reduce(fake_cuda):
    tp = cuda_group(all_reduce_timing_interval=2)
    for _ in range(2):
        tp.all_reduce(CUDA_TENSOR)
    fake_cuda.complete_all()
    assert tp.all_reduce_latency.count == 0  # an untimed call reads nothing
    tp.all_reduce(CUDA_TENSOR)  # the next timed call reads the completed pair, without a drain
    assert tp.all_reduce_latency.count == 1
    assert tp.all_reduce_latency.num_pending_events == 1  # its own pair, still running


def test_pending_event_pairs_are_bounded_by_dropping_the_oldest(fake_cuda):
    tp = cuda_group(all_reduce_latency=LatencyRecorder(max_pending_events=3),
                    all_reduce_timing_interval=1)
    for _ in range(5):  # the device never gets there
        tp.all_reduce(CUDA_TENSOR)
    assert tp.all_reduce_latency.num_pending_events == 3
    assert tp.all_reduce_latency.num_dropped_events == 2
    fake_cuda.complete_all()
    assert tp.all_reduce_latency.drain() == [pytest.approx(0.0015)] * 3


def test_summary_reads_completed_timings(fake_cuda):
    tp = cuda_group(all_reduce_timing_interval=1)
    tp.all_reduce(CUDA_TENSOR)
    assert tp.all_reduce_latency.summary()["count"] == 0
    fake_cuda.complete_all()
    assert tp.all_reduce_latency.summary() == pytest.approx(
        {"count": 1, "p50_s": 0.0015, "p99_s": 0.0015, "mean_s": 0.0015})


def test_no_events_in_a_capture_the_timer_was_not_told_of(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tp = cuda_group(all_reduce_timing_interval=1)
    tp.all_reduce(CUDA_TENSOR)
    assert fake_cuda.num_all_reduces == 1
    assert fake_cuda.num_events == 0


def test_sampled_event_timer_alone():
    device = FakeDevice()
    recorder = LatencyRecorder()
    timer = EventTimer(recorder, every=3, new_event=lambda external: device.event(True),
                       is_capturing=lambda: False)
    starts = [timer.start() for _ in range(4)]
    assert [s is not None for s in starts] == [True, False, False, True]
    timer.stop(starts[0])
    timer.stop(None)  # an untimed call: nothing to hand over
    assert recorder.num_pending_events == 1
    device.complete_all()
    assert recorder.collect() == 1
    assert recorder.collect() == 0


def test_timing_interval_must_be_positive():
    with pytest.raises(ValueError, match="all_reduce_timing_interval"):
        TPGroupConfig(0, 2, "tcp://127.0.0.1:1", all_reduce_timing_interval=0)
    with pytest.raises(ValueError, match="N >= 1"):
        EventTimer(LatencyRecorder(), every=0, new_event=lambda external: None,
                   is_capturing=lambda: False)


def test_cpu_all_reduce_is_timed_on_the_host_every_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _forbid_host_sync)  # no events on CPU
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)
    tp = TPGroup(0, 2, torch.device("cpu"))
    for _ in range(3):
        tp.all_reduce(torch.ones(2))
    samples = tp.all_reduce_latency.drain()
    assert len(samples) == 3 and all(s >= 0.0 for s in samples)
    assert tp.all_reduce_latency.drain() == []


def _gloo_all_reduces(rank, world, init_method, results):
    tp = init_tp_group(TPGroupConfig(rank, world, init_method), torch.device("cpu"))
    for _ in range(5):
        tp.all_reduce(torch.ones(1024))
    samples = tp.all_reduce_latency.drain()
    results.put((rank, len(samples), all(s > 0.0 for s in samples),
                 tp.all_reduce_latency.num_pending_events))
    tp.destroy()


@pytest.mark.multiproc
def test_gloo_group_records_every_all_reduce():
    assert run_two_ranks(_gloo_all_reduces) == [(0, 5, True, 0), (1, 5, True, 0)]


def _late_rank(rank, world, init_method, delay_s, results):
    # A step's collectives wait 1 s; rank 1 finishes "loading" 3 s after rank 0.
    tp = init_tp_group(TPGroupConfig(rank, world, init_method, timeout_s=1.0),
                       torch.device("cpu"))
    if rank == 1:
        time.sleep(delay_s)
    try:
        tp.wait_for_all_ranks()
        tp.all_reduce(torch.ones(4))  # the first step: the ranks now start it together
        results.put((rank, "ok"))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        tp.destroy()


@pytest.mark.multiproc
def test_ranks_that_finish_loading_apart_wait_for_each_other_past_the_step_timeout():
    assert run_two_ranks(_late_rank, 3.0) == [(0, "ok"), (1, "ok")]
