"""The tokens a group's scheduler has yet to compute without a KV block: its load report's
waiting demand, taken on the engine thread after every step.

A waiting request needs blocks only past the leading blocks the pool has cached for it (the
router charges it so too), so the report looks its prefix up. A full lookup per waiting request
per report costs milliseconds with a long queue (docs/benchmarks/load-report.md), a large part
of a GPU decode step. So a report walks at most ``max_lookups``
blocks in all, starting where the last report's budget ran out, and each request's walk goes on
from where it stopped: the blocks it found stay cached until the pool evicts a block, and only
then does a walk start over. A request not walked yet counts its whole prompt (as if nothing
were cached); one whose walk is stale after an eviction counts what it last found until its
turn comes again.
"""

from __future__ import annotations

import itertools
from typing import Dict, Tuple

from kv.prefix_hash import extend_block_hashes
from workers.request import Request
from workers.scheduler import Scheduler

MAX_LOOKUPS = 2048  # blocks looked up per report (its cost: docs/benchmarks/load-report.md)


class WaitingDemand:
    """Each waiting request's cached prefix as found so far, walked ``max_lookups`` blocks per
    report at most: a report starts where the last one's budget ran out, so that every request's
    walk has its turn however long the queue (the queue's front leaving in between moves that
    place back a little: a few requests wait for the next round)."""

    def __init__(self, max_lookups: int = MAX_LOOKUPS) -> None:
        if max_lookups < 1:
            raise ValueError(f"max_lookups must be at least 1, got {max_lookups}")
        self.max_lookups = max_lookups
        # request -> (the pool's eviction count when its walk last moved, cached blocks found)
        self._walks: Dict[Request, Tuple[int, int]] = {}
        self._next = 0  # where in the queue the next report starts walking

    def uncomputed_tokens(self, sched: Scheduler) -> int:
        """Tokens the scheduler's requests have yet to compute that hold no KV block yet: a
        waiting request's past its cached leading blocks, and the rest of the prompt of a running
        one still prefilling in chunks (its blocks grow chunk by chunk). A loading request's
        blocks are held for what it restores."""
        kv, budget, walks = sched.kv, self.max_lookups, {}
        evictions = kv.pool.num_evicted
        queue = list(sched.waiting)
        first, self._next = (self._next if self._next < len(queue) else 0), 0
        waiting = 0
        for index in itertools.chain(range(first, len(queue)), range(first)):
            r = queue[index]
            stamp, found = self._walks.get(r, (evictions, 0))
            if budget > 0:
                start = found if stamp == evictions else 0
                extend_block_hashes(r.block_hashes, r.all_token_ids, kv.block_size)
                found = kv.count_cached_blocks(r.all_token_ids, r.block_hashes, start, budget)
                cut = found - start == budget  # the budget ran out inside this walk
                budget -= found - start + 1  # the blocks found and the miss that ends the walk
                stamp = evictions
                if budget <= 0:  # the next report goes on here (or with the next request)
                    self._next = index if cut else index + 1
            walks[r] = (stamp, found)
            waiting += r.num_tokens - max(r.num_computed_tokens, found * kv.block_size)
        self._walks = walks
        return waiting + sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.running
                             if r.num_computed_tokens < r.num_prompt_tokens)
