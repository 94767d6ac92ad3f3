"""Where the ranks of a group meet: rank 0's listening socket, open from the moment its address is
chosen until rank 0's store serves on it.

A port picked by binding port 0, closed, and bound again when rank 0 reaches
``init_process_group`` (after its other ranks were launched) can be taken in between by any
process of the node: many groups starting at once, Ray's own workers. Rank 0's store then fails
with ``EADDRINUSE`` and the group never forms. Here the socket stays bound and listening; the
other ranks' connections wait in its backlog, and rank 0's ``TCPStore`` takes it over
(``master_listen_fd``, a duplicate of its descriptor).
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from datetime import timedelta

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


def listening_store(init_method: str, listen_fd: int, world_size: int,
                    timeout: timedelta) -> dist.Store:
    """Rank 0's store for ``init_process_group(store=...)``, served on the socket ``listen_fd``
    (a `RendezvousSocket`'s), keyed as the ``tcp://`` rendezvous of the other ranks keys theirs."""
    url = urllib.parse.urlsplit(init_method)
    store = dist.TCPStore(url.hostname, url.port, world_size, is_master=True, timeout=timeout,
                          master_listen_fd=os.dup(listen_fd))
    return dist.PrefixStore("default_pg", store)
