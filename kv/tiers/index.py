"""Rank 0's view of one lower KV tier (host memory or disk): which block hash sits in which slot.

The index holds bookkeeping only; the bytes live on every rank (``kv/tiers/host_buffer.py``,
``kv/tiers/disk/store.py``) and move by ``kv/tiers/ops.py`` ops. An entry is usable as soon as the op that
fills its slot is issued, because every rank runs ops first in, first out: a later read of that slot
is queued behind the write. Slots come from a min-heap so fresh slots are handed out in ascending
order and disk writes of a batch land on consecutive slots (large sequential I/O).

Besides indexed entries, a slot can be held privately (a preempted request's partly filled last
block, which has no prefix hash); private slots are never evicted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from kv.eviction import EvictionPolicy
from kv.prefix_hash import BlockHash


@dataclass(frozen=True)
class TierEntry:
    slot: int
    token_ids: Tuple[int, ...]


class TierIndex:
    """Entries (hash -> slot and tokens), free slots and the eviction policy of one tier.

    Costs: ``lookup``, ``insert``, ``remove`` O(1) plus the policy's cost; ``take_slot`` O(log n).
    """

    def __init__(self, name: str, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots < 1:
            raise ValueError(f"{name} tier needs at least one block, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self.policy = policy
        self.entries: Dict[BlockHash, TierEntry] = {}
        self._free_slots: List[int] = list(range(num_slots))  # already a valid heap
        self._num_private = 0
        self.num_queries = 0  # blocks looked up here (after a miss in the tier above)
        self.num_hits = 0

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Optional[TierEntry]:
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != tuple(token_ids):
            return None
        return entry

    def recent_hashes(self) -> Iterator[BlockHash]:
        """Every indexed hash, the most recently indexed first (a spill or a disk read indexes
        the entry whose slot it fills). Lazy: take what you need."""
        return reversed(self.entries)

    def can_take(self) -> bool:
        """Whether ``take_slot`` succeeds (a free slot, or an indexed entry to evict)."""
        return bool(self._free_slots) or len(self.policy) > 0

    def take_slot(self) -> Tuple[int, Optional[Tuple[BlockHash, TierEntry]]]:
        """A slot to fill: a free one, else the policy victim's, returned as (hash, entry) evicted."""
        if self._free_slots:
            return heapq.heappop(self._free_slots), None
        victim = self.policy.victim()
        if victim is None:
            raise RuntimeError(f"{self.name} tier: every slot is private")
        entry = self.remove(victim)
        return heapq.heappop(self._free_slots), (victim, entry)

    def insert(self, block_hash: BlockHash, token_ids: Sequence[int], slot: int) -> None:
        """Index a slot from ``take_slot`` under ``block_hash``."""
        assert block_hash not in self.entries, f"{self.name} tier already holds {block_hash:x}"
        self.entries[block_hash] = TierEntry(slot, tuple(token_ids))
        self.policy.insert(block_hash)

    def remove(self, block_hash: BlockHash) -> TierEntry:
        """Drop an entry and free its slot."""
        entry = self.entries.pop(block_hash)
        self.policy.discard(block_hash)  # absent while held
        heapq.heappush(self._free_slots, entry.slot)
        return entry

    def hold(self, block_hash: BlockHash) -> None:
        """Make an entry unevictable until ``unhold`` (a restore is about to read it)."""
        if block_hash in self.policy:
            self.policy.remove(block_hash)

    def unhold(self, block_hash: BlockHash) -> None:
        if block_hash in self.entries and block_hash not in self.policy:
            self.policy.insert(block_hash)

    def discard_slot(self, block_hash: BlockHash, slot: int) -> bool:
        """Drop ``block_hash`` if it still sits in ``slot`` (a failed op's entry); True if dropped."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.slot != slot:
            return False
        self.remove(block_hash)
        return True

    def take_private(self) -> Tuple[int, Optional[Tuple[BlockHash, TierEntry]]]:
        """A slot held outside the index until ``release_private``; may evict like ``take_slot``."""
        slot, evicted = self.take_slot()
        self._num_private += 1
        return slot, evicted

    def release_private(self, slot: int) -> None:
        assert self._num_private > 0
        self._num_private -= 1
        heapq.heappush(self._free_slots, slot)

    def restore_entries(self, entries: Dict[BlockHash, TierEntry]) -> None:
        """Adopt entries recovered from a snapshot (warm restart) into an empty index."""
        assert not self.entries and self.num_used == 0
        taken = set()
        for block_hash, entry in entries.items():
            self.entries[block_hash] = entry
            self.policy.insert(block_hash)
            taken.add(entry.slot)
        self._free_slots = [s for s in range(self.num_slots) if s not in taken]
