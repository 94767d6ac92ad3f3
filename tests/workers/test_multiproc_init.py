"""The rendezvous of a group's ranks: its address (IPv4, and IPv6 in brackets: an IPv6-only
cluster's node address, as torch's ``tcp://`` init method reads it), rank 0's socket, held
listening from the moment the engine picks its port, and rank 0's watch over the other ranks
while they join."""

import dataclasses
import re
import socket
import time
import urllib.parse
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel.rendezvous import RendezvousSocket
from parallel.tp_group import TPGroupConfig
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.multiproc import RankProcesses, free_tcp_init_method
from workers.rank import RankConfig
from workers.sampling_params import SamplingParams


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


@pytest.mark.multiproc
def test_a_port_taken_while_the_ranks_start_cannot_break_the_rendezvous(tiny_llama):
    """Rank 0 listens on the rendezvous port from the moment the engine picks it: another
    process binding it while ranks 1..N-1 start (64 groups starting on one node, Ray's own
    workers) cannot take it. A port picked, closed and bound again later could be lost there."""
    squatter = socket.socket(socket.AF_INET)  # another process's socket, held to the end
    squatted = []

    def launcher(configs):
        url = urllib.parse.urlsplit(configs[0].group.init_method)
        try:
            squatter.bind((url.hostname, url.port))
            squatter.listen()
            squatted.append(True)
        except OSError:
            squatted.append(False)
        return RankProcesses(configs)

    config = EngineConfig(model=str(tiny_llama), tp_size=2, num_kv_blocks=64)
    engine = None
    try:
        engine = LLMEngine(config, launcher=launcher)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
    finally:
        squatter.close()
        if engine is not None:
            engine.shutdown()
    assert squatted == [False] and len(outputs[-1].output_token_ids) == 3


def test_only_rank_0_of_a_real_group_takes_a_listening_socket():
    with pytest.raises(ValueError, match="listen_fd is rank 0's socket.*not rank 1's of 2"):
        TPGroupConfig(1, 2, "tcp://127.0.0.1:1", listen_fd=3)
    with pytest.raises(ValueError, match="not rank 0's of 1"):
        TPGroupConfig(0, 1, listen_fd=3)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_rendezvous_socket_listens_on_ipv6_in_brackets():
    rendezvous = RendezvousSocket("::1")
    try:
        assert re.fullmatch(r"tcp://\[::1\]:\d+", rendezvous.init_method)
        port = int(rendezvous.init_method.rsplit(":", 1)[1])
        with socket.create_connection(("::1", port), timeout=5):
            pass  # accepted into the backlog before any store serves it
    finally:
        rendezvous.close()


def test_local_ranks_beyond_the_gpus_cuda_shows_are_refused_before_any_starts(monkeypatch):
    # Rank 1 on cuda:1 of a one-GPU machine failed in its process while rank 0 waited for it at
    # the rendezvous: a 10-minute hang (RENDEZVOUS_S) for a --tp too large.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    config = RankConfig("/nowhere", TPGroupConfig(1, 2, "tcp://127.0.0.1:1"), "cuda:1",
                        "float16", 16, 16, 256)
    with pytest.raises(ValueError, match=re.escape(
            "TP 2 runs rank 1 on cuda:1, but CUDA shows this machine 1 GPU(s) "
            "(CUDA_VISIBLE_DEVICES=3)")):
        RankProcesses([config])


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_rank_that_fails_before_the_rendezvous_fails_the_engine_at_once(tiny_llama):
    """Rank 0 waited for it at the rendezvous for RENDEZVOUS_S (10 minutes); it now watches the
    other ranks while it waits, and raises the first one's error."""
    def launcher(configs):  # rank 1 fails in its process before it joins the group
        return RankProcesses([dataclasses.replace(c, num_threads=-1) for c in configs])

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="positive"):
        LLMEngine(EngineConfig(model=str(tiny_llama), tp_size=2, num_kv_blocks=64),
                  launcher=launcher)
    assert time.monotonic() - started < 60
