"""The Serve port a test or script picks lies where Ray will not put one of its own servers."""

from __future__ import annotations

import socket

import pytest

from cluster import ports
from cluster.ports import RAY_WORKER_PORTS_END, ephemeral_start, free_port


def test_the_port_is_outside_rays_worker_ports_and_the_kernels_ephemeral_range():
    for _ in range(20):
        port = free_port()
        assert RAY_WORKER_PORTS_END < port < ephemeral_start()


def test_the_port_is_free_on_every_address():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", port))


def test_a_port_held_elsewhere_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        assert not ports.bindable(taken)
        monkeypatch.setattr(ports, "RAY_WORKER_PORTS_END", taken - 1)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: taken + 1)
        with pytest.raises(RuntimeError, match=f"no free port in {taken}-{taken}"):
            ports.free_port()


def test_an_ephemeral_range_below_rays_worker_ports_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 15000)
    with pytest.raises(RuntimeError, match="ip_local_port_range starts at 15000"):
        free_port()
