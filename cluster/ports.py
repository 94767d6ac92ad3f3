"""A free TCP port for a local Serve proxy that Ray itself will not take a moment later.

A port the kernel hands out for ``bind(("", 0))`` lies in its ephemeral range, and that is where
Ray picks the ports of its own servers (GCS, raylet, object manager, metrics agent: a random port
between a kernel-given one and 65535), while its workers' gRPC servers take 10002-19999. A test
that picks its Serve port the kernel's way and then starts Ray can find a Ray gRPC server on it
(a CI run read an HTTP/2 frame as the proxy's status line). Ports from 20000 up to the start of
the ephemeral range are used by neither.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19999  # Ray's default --max-worker-port
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
ATTEMPTS = 200


def ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int) -> bool:
    """Whether ``port`` is free on every address of this host, as Serve's gRPC proxy binds
    ``[::]``: a port free on 127.0.0.1 alone may be held on the node's own address."""
    try:
        sock = socket.socket(socket.AF_INET6)  # dual stack: the IPv4 addresses too
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address = "::"
    except OSError:  # no IPv6 here
        sock, address = socket.socket(), "0.0.0.0"
    with sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now on every address, between Ray's worker ports and the ephemeral range."""
    low, high = RAY_WORKER_PORTS_END + 1, ephemeral_start() - 1
    if high < low:
        raise RuntimeError(f"{EPHEMERAL_RANGE_FILE} starts at {high + 1}: no port below it is "
                           f"free of Ray's worker ports (up to {RAY_WORKER_PORTS_END})")
    for port in random.sample(range(low, high + 1), min(ATTEMPTS, high - low + 1)):
        if bindable(port):
            return port
    raise RuntimeError(f"no free port in {low}-{high} after {ATTEMPTS} tries")
