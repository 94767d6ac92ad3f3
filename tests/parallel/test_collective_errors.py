"""A collective that raises is counted by its TP group (``num_collective_errors``) and re-raised:
rank 1 (a real process) leaves the group, and rank 0's next all-reduce fails on the dead peer."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from parallel.tp_group import TPGroup, TPGroupConfig, init_tp_group
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
        assert torch.equal(tensor, torch.full((4,), 2.0)) and tp.num_collective_errors == 0
        peer.join(60)
        with pytest.raises(RuntimeError):
            tp.all_reduce(tensor)
        assert tp.num_collective_errors == 1
    finally:
        peer.join(5)
        if peer.is_alive():
            peer.kill()
        tp.destroy()


def test_counting_errors_wraps_any_collective():
    tp = TPGroup(0, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError):
        with tp.counting_errors():
            raise RuntimeError("Connection closed by peer")
    with tp.counting_errors():
        pass
    assert tp.num_collective_errors == 1
