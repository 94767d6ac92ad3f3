"""Where the ranks of a group meet: rank 0's listening socket, open from the moment its address is
chosen until rank 0's store serves on it, and rank 0's wait for the others there.

A port picked by binding port 0, closed, and bound again when rank 0 reaches
``init_process_group`` (after its other ranks were launched) can be taken in between by any
process of the node: many groups starting at once, Ray's own workers. Rank 0's store then fails
with ``EADDRINUSE`` and the group never forms. Here the socket stays bound and listening; the
other ranks' connections wait in its backlog, and rank 0's ``TCPStore`` takes it over
(``master_listen_fd``, a duplicate of its descriptor).

Rank 0 then waits for every other rank to announce itself on the store (`announce`, just
before it joins) and, while it waits, asks after them (``check_peers``: the launcher's ``check``,
which raises a rank's error). A rank that fails before it joins (a GPU it cannot have, an import)
used to leave rank 0 waiting for it for ``RENDEZVOUS_S``: ten minutes.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.parse
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist


class RendezvousSocket:
    """A listening socket on ``host``, any free port; ``init_method`` is its ``tcp://`` address
    (an IPv6 host in brackets)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(socket.SOMAXCONN)
        except OSError:
            self._sock.close()
            raise
        port = self._sock.getsockname()[1]
        self.init_method = (f"tcp://[{host}]:{port}" if family == socket.AF_INET6
                            else f"tcp://{host}:{port}")

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        """Close this process's descriptor (a store given a duplicate keeps listening)."""
        self._sock.close()


_ANNOUNCED = "tpserve/announced/{}"  # a rank's key, set just before it joins the group
_POLL_S = 0.1


def listening_store(init_method: str, listen_fd: int, world_size: int, timeout: timedelta,
                    check_peers: Optional[Callable[[], None]] = None) -> dist.Store:
    """Rank 0's store for ``init_process_group(store=...)``, served on the socket ``listen_fd``
    (a `RendezvousSocket`'s), keyed as the ``tcp://`` rendezvous of the other ranks keys theirs;
    returned once every other rank has announced itself. ``check_peers`` is called while it
    waits and raises what stopped a rank; without a word from one, ``TimeoutError``."""
    url = urllib.parse.urlsplit(init_method)
    store = dist.TCPStore(url.hostname, url.port, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=os.dup(listen_fd))
    waiting = [_ANNOUNCED.format(rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        waiting = [key for key in waiting if not store.check([key])]
        if not waiting:
            break
        if check_peers is not None:
            check_peers()
        if time.monotonic() > deadline:
            missing = [int(key.rsplit("/", 1)[1]) for key in waiting]
            raise TimeoutError(f"rank(s) {missing} of a group of {world_size} did not reach "
                               f"the rendezvous at {init_method} in "
                               f"{timeout.total_seconds():.0f} s")
        time.sleep(_POLL_S)
    return dist.PrefixStore("default_pg", store)


def announce(init_method: str, rank: int, timeout: timedelta) -> None:
    """Tell rank 0's store that ``rank`` is about to join (see `listening_store`)."""
    url = urllib.parse.urlsplit(init_method)
    client = dist.TCPStore(url.hostname, url.port, is_master=False, timeout=timeout,
                           wait_for_workers=False)
    client.set(_ANNOUNCED.format(rank), "1")
