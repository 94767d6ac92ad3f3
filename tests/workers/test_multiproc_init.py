"""The rendezvous address of a group's ranks: IPv4, and IPv6 in brackets (an IPv6-only cluster's
node address), as torch's ``tcp://`` init method reads it."""

import re
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from workers.multiproc import free_tcp_init_method


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_an_ipv4_host_gives_host_and_port():
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", free_tcp_init_method())


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_host_goes_in_brackets_and_torch_rendezvous_on_it():
    init = free_tcp_init_method("::1")
    assert re.fullmatch(r"tcp://\[::1\]:\d+", init)
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        total = torch.ones(2)
        dist.all_reduce(total)
        assert total.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
