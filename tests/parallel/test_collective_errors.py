"""A collective that raises is counted by its TP group, by kind (``collective_errors``), and
re-raised: rank 1 (a real process) leaves the group, and rank 0's next all-reduce fails on the
dead peer; a rank whose peer never joins a collective counts a timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from parallel.collective_errors import CollectiveErrors, error_kind, sum_counts
from parallel.tp_group import TPGroup, TPGroupConfig, init_tp_group
from two_ranks import run_two_ranks
from workers.multiproc import free_tcp_init_method


def _rank1_reduces_once_then_dies(init_method: str) -> None:
    tp = init_tp_group(TPGroupConfig(1, 2, init_method, timeout_s=30), torch.device("cpu"))
    tp.all_reduce(torch.ones(4))
    # Exits without destroying its group: a rank that died mid-serving.


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_an_all_reduce_with_a_dead_peer_is_counted_and_raised():
    init_method = free_tcp_init_method()
    peer = mp.get_context("spawn").Process(target=_rank1_reduces_once_then_dies,
                                           args=(init_method,))
    peer.start()
    tp = init_tp_group(TPGroupConfig(0, 2, init_method, timeout_s=30), torch.device("cpu"))
    try:
        tensor = torch.ones(4)
        tp.all_reduce(tensor)
        assert torch.equal(tensor, torch.full((4,), 2.0)) and tp.collective_errors.total == 0
        peer.join(60)
        with pytest.raises(RuntimeError):
            tp.all_reduce(tensor)
        assert tp.collective_errors.counts() == {"error": 1, "timeout": 0, "hang": 0}
    finally:
        peer.join(5)
        if peer.is_alive():
            peer.kill()
        tp.destroy()


def _rank0_stays_away(rank, world, init_method, results):
    # A step's collectives wait 1 s; rank 0 never starts the all-reduce rank 1 waits in.
    tp = init_tp_group(TPGroupConfig(rank, world, init_method, timeout_s=1.0),
                       torch.device("cpu"))
    tp.wait_for_all_ranks()
    if rank == 0:
        time.sleep(2.5)
    else:
        try:
            tp.all_reduce(torch.ones(4))
        except RuntimeError:
            pass
    results.put((rank, tp.collective_errors.counts()))
    tp.destroy()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_collective_timing_out_on_rank_1_is_counted_there_as_a_timeout():
    rows = run_two_ranks(_rank0_stays_away)
    assert rows == [(0, {"error": 0, "timeout": 0, "hang": 0}),
                    (1, {"error": 0, "timeout": 1, "hang": 0})]


def test_counting_errors_wraps_any_collective():
    tp = TPGroup(0, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError):
        with tp.counting_errors():
            raise RuntimeError("Connection closed by peer")
    with tp.counting_errors():
        pass
    assert tp.collective_errors.total == 1
    assert tp.collective_errors.counts()["error"] == 1


@pytest.mark.parametrize("message, kind", [
    ("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1500ms for recv operation to "
     "complete", "timeout"),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
     "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", "timeout"),
    ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10661", "error"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", "error"),
])
def test_error_kind_reads_what_gloo_and_nccl_say(message, kind):
    assert error_kind(RuntimeError(message)) == kind


def test_counts_start_at_zero_for_every_kind_and_refuse_unknown_kinds():
    errors = CollectiveErrors()
    assert errors.counts() == {"error": 0, "timeout": 0, "hang": 0}
    errors.count("hang")
    assert errors.total == 1
    with pytest.raises(ValueError, match="'stalled' is not one of"):
        errors.count("stalled")
    assert sum_counts([errors.counts(), {"error": 2, "timeout": 0, "hang": 0}]) == {
        "error": 2, "timeout": 0, "hang": 1}
