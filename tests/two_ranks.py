"""Two real rank processes (spawn) for the tests of a TP group's collectives."""

from __future__ import annotations

import torch.multiprocessing as mp

from workers.multiproc import free_tcp_init_method


def run_two_ranks(target, *args) -> list:
    """``target(rank, 2, init_method, *args, results)`` in two spawned processes; what they put
    in ``results``, sorted."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = free_tcp_init_method()
    procs = [ctx.Process(target=target, args=(r, 2, init, *args, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return rows
