"""When a cached block goes down a tier, and how fast: the write policy and the spill pacer.

Three policies (``--kv-write-policy``), as SGLang's HiCache and vLLM's offloading name them:

- ``write_through``: every cached device block is copied to host when its last request releases
  it, hit or not. Evicting it later costs nothing, but most blocks are never asked for again.
- ``write_through_selective``: the same, only for blocks that have been hit at least
  ``--kv-write-threshold`` times (a prefix found in any tier counts one hit per block); the same
  rule sends a host block on to disk when host evicts it. One-off prompts never leave the device.
- ``write_back``: a block goes down only when it is evicted from the tier above (device -> host
  when the device pool reuses it, host -> disk when host does). Nothing is copied that the
  tier above could still hold; the step that reuses an evicted block waits for that block's copy.

Under every policy the disk tier receives only what host evicts (an inclusive hierarchy below the
device). Write-through spills go through a ``SpillPacer``: without ``--kv-spill-gbps`` they are
issued as soon as their blocks are released; with it, at most that many bytes per second (a token
bucket refilled by wall time), so the copy threads cannot starve the compute threads, and a
queued block that the device pool evicts, or that stops holding its hash, before its turn is
dropped (``num_dropped``): a recompute later, never a wait now.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, List, Optional

from kv.prefix_hash import BlockHash

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def check_write_policy(policy: str, threshold: int, spill_gbps: Optional[float]) -> None:
    """Raise ValueError naming the option when a write-policy setting is out of range."""
    if policy not in WRITE_POLICIES:
        raise ValueError(f"--kv-write-policy must be one of {', '.join(WRITE_POLICIES)}, "
                         f"got {policy!r}")
    if threshold < 1:
        raise ValueError(f"--kv-write-threshold must be at least 1 hit, got {threshold}")
    if spill_gbps is not None and not spill_gbps > 0:
        raise ValueError(f"--kv-spill-gbps must be positive (omit it for no bound), "
                         f"got {spill_gbps}")


class HitCounter:
    """Prefix hits per block hash, for the selective policy; remembers at most ``capacity``
    hashes (the least recently hit are forgotten first). O(1) per hit and per lookup."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"HitCounter capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._hits: "OrderedDict[BlockHash, int]" = OrderedDict()

    def hit(self, block_hash: BlockHash) -> None:
        self._hits[block_hash] = self._hits.pop(block_hash, 0) + 1
        if len(self._hits) > self.capacity:
            self._hits.popitem(last=False)

    def __getitem__(self, block_hash: BlockHash) -> int:
        return self._hits.get(block_hash, 0)

    def __len__(self) -> int:
        return len(self._hits)


class SpillPacer:
    """A token bucket of bytes in front of write-through spills.

    ``offer`` queues an item (a block to spill); ``take`` returns the items whose bytes the
    bucket covers now, oldest first, and refills the bucket by the time since the last call
    (at most ``burst_s`` seconds' worth). Without a rate every queued item is taken at once.
    ``is_current`` says whether a queued item is still worth spilling when its turn comes; the
    ones that are not are dropped and counted. The queue holds at most ``max_pending`` items:
    beyond, the oldest are dropped. Items are keyed, so a key offered twice is queued once.
    """

    def __init__(self, item_bytes: int, gbps: Optional[float], max_pending: int,
                 burst_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self._item_bytes = max(1, item_bytes)
        self._rate = gbps * 1e9 if gbps is not None else None  # bytes per second
        self._burst = (max(self._rate * burst_s, float(self._item_bytes))
                       if self._rate is not None else 0.0)
        self._max_pending = max(1, max_pending)
        self._clock = clock
        self._budget = self._burst
        self._last = clock()
        self._pending: "OrderedDict[object, object]" = OrderedDict()
        self.num_dropped = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def offer(self, key: object, item: object) -> None:
        self._pending[key] = item
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self.num_dropped += 1

    @property
    def item_bytes(self) -> int:
        """What one item costs the bucket."""
        return self._item_bytes

    @property
    def is_bounded(self) -> bool:
        """Whether a rate bounds the spills (else ``take`` returns every queued item)."""
        return self._rate is not None

    def pop(self, key: object) -> Optional[object]:
        """Take a queued item out of the queue now (not counted as dropped); None if absent."""
        return self._pending.pop(key, None)

    def discard(self, key: object) -> bool:
        """Drop a queued item (its block is going away); True if it was queued."""
        if self._pending.pop(key, None) is None:
            return False
        self.num_dropped += 1
        return True

    def take(self, is_current: Callable[[object], bool]) -> List[object]:
        """The queued items the bucket pays for now, oldest first (current ones only)."""
        self._refill()
        taken: List[object] = []
        while self._pending and (self._rate is None or self._budget >= self._item_bytes):
            _, item = self._pending.popitem(last=False)
            if not is_current(item):
                self.num_dropped += 1
                continue
            taken.append(item)
            if self._rate is not None:
                self._budget -= self._item_bytes
        return taken

    def wait_s(self) -> float:
        """How long until the bucket pays for the oldest queued item (0: now, or nothing is
        queued, or no rate bounds the spills)."""
        if self._rate is None or not self._pending:
            return 0.0
        self._refill()
        return max(0.0, (self._item_bytes - self._budget) / self._rate)

    def _refill(self) -> None:
        now = self._clock()
        if self._rate is not None:
            self._budget = min(self._burst, self._budget + (now - self._last) * self._rate)
        self._last = now
