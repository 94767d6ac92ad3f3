"""Eviction policies: which of a KV tier's evictable blocks goes first.

Every tier (device, host, disk) keeps its evictable blocks in an ``EvictionPolicy`` and asks it for a
``victim()`` when it needs room. Two policies:

* ``LRUPolicy``: least recently inserted-or-accessed first. O(1) for everything.
* ``HotnessPolicy``: coldest first, by a score kept in a ``HotnessTracker``.

Hotness score. The clock of a ``HotnessTracker`` advances by one for every request that looks up the
cache (``tick``), not by wall time. A block's score is an exponential moving average, over those
requests, of "this request used the block"::

    score(now) = score(last) * decay ** (now - last) + (1 - decay)     on an access at ``now``
    score(now) = score(last) * decay ** (now - last)                   between accesses

A block used by every request tends to 1 (after n consecutive uses it is ``1 - decay ** n``), so a
hold threshold of 0.9 means "used by nearly all recent requests", e.g. a shared system prompt. One
tracker is shared by the policies of all tiers, so a block keeps its score when it moves between
tiers.

Ordering trick. Between accesses, ``log score(now) = priority + now * log(decay)`` with the
time-invariant ``priority = log score(last) - last * log(decay)``. Comparing priorities therefore
compares current scores at any common time, and a heap keyed by priority never needs reordering as
the clock advances: only an access changes a key's priority, and it only ever grows.

Holding. A key whose score exceeds the hold threshold (``--kv-pin-threshold``) is held, or hot (not
"pinned": that names page-locked host memory): it is evicted only as a last resort, and callers
count those evictions. ``victim()`` always returns the coldest key, and if that key is held then
every present key is held. Returning it anyway means a held set larger than the tier cannot
deadlock allocation; so a held block may still leave the device, and the tiers below keep a copy
of it like of any other block (``kv/tiers/hierarchy.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
import heapq
import itertools
import math
from typing import Dict, Hashable, List, Optional, Tuple


class EvictionPolicy(ABC):
    """Which of a tier's evictable blocks goes first.

    Holds a set of keys (block hashes). ``victim()`` names the next key to evict without removing
    it; the tier evicts it and then calls ``remove``.
    """

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """Make ``key`` evictable. Raises ``ValueError`` if it already is."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Make ``key`` no longer evictable. Raises ``KeyError`` if it is not present."""

    def discard(self, key: Hashable) -> None:
        """Remove ``key`` if present; otherwise do nothing."""
        if key in self:
            self.remove(key)

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def victim(self) -> Optional[Hashable]:
        """The next key to evict (left in place), or ``None`` when no key is present."""

    @abstractmethod
    def record_access(self, key: Hashable) -> None:
        """A request used this block; ``key`` may or may not be present."""

    def is_held(self, key: Hashable) -> bool:
        """Whether ``key`` is hot enough to be evicted only as a last resort. ``False`` here."""
        return False


class LRUPolicy(EvictionPolicy):
    """Least recently inserted-or-accessed key first. Every operation is O(1)."""

    def __init__(self) -> None:
        self._keys: "OrderedDict[Hashable, None]" = OrderedDict()  # oldest first

    def insert(self, key: Hashable) -> None:
        if key in self._keys:
            raise ValueError(f"key {key!r} is already evictable")
        self._keys[key] = None

    def remove(self, key: Hashable) -> None:
        del self._keys[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def victim(self) -> Optional[Hashable]:
        return next(iter(self._keys), None)

    def record_access(self, key: Hashable) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)


_NEGLIGIBLE = 1e-12  # a score this small: no access in the last several hundred ticks


class HotnessTracker:
    """Per-block EMA of "the request used this block", over a clock of requests.

    Shared by the policies of all tiers. Memory is one entry per key accessed in the last few
    hundred ticks: every ``prune_every`` ticks, keys whose score fell below ``_NEGLIGIBLE`` are
    dropped (O(n), amortized O(n / prune_every) per tick); a dropped key still held by a tier ranks
    as coldest, which its score already made it. Operations are O(1) otherwise.
    """

    def __init__(self, decay: float = 0.95, prune_every: int = 8192) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        self._prune_every = prune_every
        self._log_decay = math.log(decay)
        self._now = 0
        self._entries: Dict[Hashable, Tuple[float, int]] = {}  # key -> (score at last, last tick)

    @property
    def now(self) -> int:
        """The number of ticks so far."""
        return self._now

    def tick(self) -> None:
        """One request looked up the cache: the clock advances by one."""
        self._now += 1
        if self._now % self._prune_every == 0:
            self._entries = {key: entry for key, entry in self._entries.items()
                             if self.score(key) >= _NEGLIGIBLE}

    def access(self, key: Hashable) -> None:
        """This request used the block. Counts at most once per tick per key."""
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = (1.0 - self.decay, self._now)
            return
        score, last = entry
        if last == self._now:
            return
        self._entries[key] = (score * self.decay ** (self._now - last) + (1.0 - self.decay), self._now)

    def score(self, key: Hashable) -> float:
        """The current score, in [0, 1); 0 for unknown keys."""
        entry = self._entries.get(key)
        if entry is None:
            return 0.0
        score, last = entry
        return score * self.decay ** (self._now - last)

    def priority(self, key: Hashable) -> float:
        """A time-invariant ordering key: higher means hotter now, at any common time.

        Equals ``log(score(now)) - now * log(decay)`` for every ``now``; it changes only on an
        access, and then only grows. ``-inf`` for unknown keys.
        """
        entry = self._entries.get(key)
        if entry is None:
            return -math.inf
        score, last = entry
        return math.log(score) - last * self._log_decay

    def forget(self, key: Hashable) -> None:
        """Drop ``key`` (it left every tier); its score restarts from 0 if it comes back."""
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


class HotnessPolicy(EvictionPolicy):
    """Coldest present key first, by the tracker's current score; ties go to the earlier insert.

    A min-heap of ``(priority, insertion seq, key)`` with lazy invalidation: entries of removed keys
    and superseded entries are dropped when they reach the top, and an entry made stale by an access
    through another policy sharing the tracker is re-pushed. ``insert``, ``record_access`` and
    ``victim`` cost O(log n) amortized, ``remove`` O(1); the heap is rebuilt in O(n) when dead
    entries outnumber live ones, so it stays O(n) in size. ``victim()`` only returns present keys.

    Held keys (score above ``hold_threshold``) are evicted only as a last resort: ``victim()``
    returns the coldest key, so a held victim means every present key is held. It is returned
    anyway (the caller counts that), so a held set larger than the tier cannot deadlock allocation.
    """

    def __init__(self, tracker: HotnessTracker, hold_threshold: Optional[float] = 0.9) -> None:
        if hold_threshold is not None and not 0.0 < hold_threshold <= 1.0:
            raise ValueError(f"hold_threshold (--kv-pin-threshold) must be in (0, 1] or None, "
                             f"got {hold_threshold!r}")
        self.tracker = tracker
        self.hold_threshold = hold_threshold
        self._heap: List[Tuple[float, int, Hashable]] = []
        self._live: Dict[Hashable, Tuple[float, int]] = {}  # key -> (last pushed priority, seq)
        self._seq = itertools.count()

    def insert(self, key: Hashable) -> None:
        if key in self._live:
            raise ValueError(f"key {key!r} is already evictable")
        self._push(key, next(self._seq))

    def remove(self, key: Hashable) -> None:
        del self._live[key]

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def victim(self) -> Optional[Hashable]:
        heap = self._heap
        while heap:
            priority, seq, key = heap[0]
            if self._live.get(key) != (priority, seq):
                heapq.heappop(heap)  # removed, re-inserted or superseded by a later push
            elif priority != self.tracker.priority(key):
                heapq.heappop(heap)  # accessed through another policy sharing the tracker
                self._push(key, seq)
            else:
                return key
        return None

    def record_access(self, key: Hashable) -> None:
        self.tracker.access(key)
        live = self._live.get(key)
        if live is not None and live[0] != self.tracker.priority(key):
            self._push(key, live[1])

    def is_held(self, key: Hashable) -> bool:
        """Whether the key's current score exceeds the hold threshold (never, without one)."""
        return self.hold_threshold is not None and self.tracker.score(key) > self.hold_threshold

    def _push(self, key: Hashable, seq: int) -> None:
        priority = self.tracker.priority(key)
        self._live[key] = (priority, seq)
        heapq.heappush(self._heap, (priority, seq, key))
        if len(self._heap) > 2 * len(self._live) + 16:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(priority, seq, key) for key, (priority, seq) in self._live.items()]
        heapq.heapify(self._heap)


def make_policy(
    name: str, tracker: Optional[HotnessTracker], hold_threshold: Optional[float]
) -> EvictionPolicy:
    """The policy named by ``--kv-eviction``: ``"lru"`` or ``"hotness"`` (which needs ``tracker``).

    ``tracker`` and ``hold_threshold`` (``--kv-pin-threshold``) are ignored for ``"lru"``.
    """
    if name == "lru":
        return LRUPolicy()
    if name == "hotness":
        if tracker is None:
            raise ValueError("--kv-eviction hotness needs a HotnessTracker shared by all tiers")
        return HotnessPolicy(tracker, hold_threshold)
    raise ValueError(f"--kv-eviction must be lru or hotness, got {name!r}")
