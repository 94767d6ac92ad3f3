"""A uniform fleet's state for the compiled ranking (`cluster.routing.native_rank`), and the
ranking it returns.

A fleet is uniform when every group reports a pool of the same size and block size and every
report is fresh (`is_uniform`). There, a group's rank key grows with its committed blocks among
the groups holding the same number of the request's blocks, so the groups' order by committed
blocks, then group id, does not depend on the request: `CommittedOrder` keeps it between
decisions, moved one group at a time as charges change it, and the C ranking only places the few
groups holding more than the base prefix into it. `UniformRanking` is that ranking as
`rank_groups` would return it, a `RankedGroup` made for each position read.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from operator import attrgetter
from typing import Dict, Iterator, List, Sequence, Tuple

from cluster.routing.ranking import FULL_OCCUPANCY, GroupLoad, RankedGroup, reason_of

_TOTAL = attrgetter("num_blocks_total")
_BLOCK_SIZE = attrgetter("block_size")
_AGE = attrgetter("report_age_s")


class CommittedOrder:
    """The indices of a fleet's loads by committed blocks, then group id (``order``), with each
    group's committed blocks (``committed``) and place by group id (``tie``), kept as charges
    move them (`set`: in place, so `cluster.routing.native_rank`'s fleet state holds the same lists)."""

    __slots__ = ("order", "committed", "tie", "_keys")

    def __init__(self, loads: Sequence[GroupLoad]) -> None:
        n = len(loads)
        self.tie = [0] * n  # the index's place by group id
        for place, i in enumerate(sorted(range(n), key=lambda i: loads[i].group_id)):
            self.tie[i] = place
        self.committed = [load._num_blocks_committed for load in loads]
        # one int per group that sorts as (committed, group id) does
        self._keys = [c * n + t for c, t in zip(self.committed, self.tie)]
        self.order = sorted(range(n), key=self._keys.__getitem__)

    def set(self, i: int, committed: int) -> None:
        """Group ``i`` now has ``committed`` blocks: move it to its place (O(log G) + a shift)."""
        if committed == self.committed[i]:
            return
        keys, order = self._keys, self.order
        del order[bisect_left(order, keys[i], key=keys.__getitem__)]
        self.committed[i] = committed
        keys[i] = committed * len(keys) + self.tie[i]
        insort(order, i, key=keys.__getitem__)


class UniformRanking(Sequence[RankedGroup]):
    """``rank_groups``' result for a uniform fleet: ``order[k]`` is the index (into the loads) of
    the group ranked k-th, and item k its `RankedGroup`, made when read."""

    __slots__ = ("order", "_loads", "_committed", "_prefix", "_base", "_num_blocks", "_total",
                 "_target")

    def __init__(self, order: List[int], loads: Sequence[GroupLoad], committed: List[int],
                 prefix: Dict[int, int], base: int, num_blocks: int, target: float) -> None:
        self.order = order
        self._loads, self._committed, self._prefix, self._base = loads, committed, prefix, base
        self._num_blocks, self._total, self._target = num_blocks, loads[0].num_blocks_total, target

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self._placement(i) for i in self.order[k]]
        return self._placement(self.order[k])

    def __iter__(self) -> Iterator[RankedGroup]:
        return map(self._placement, self.order)

    def cached_blocks_of(self, group_id: str) -> int:
        """The request's blocks ``group_id`` holds, as ranked (0 for a group not ranked)."""
        loads = self._loads
        for i in self.order:
            if loads[i].group_id == group_id:
                return self._prefix.get(i, self._base)
        return 0

    def longest_cached(self) -> Tuple[int, str]:
        """The most leading request blocks any ranked group holds, and that group's reason
        (the first such in rank order)."""
        if not self.order:
            return 0, ""
        held = max(self._prefix.values(), default=self._base)
        first = next(i for i in self.order if self._prefix.get(i, self._base) == held)
        return held, self._placement(first).reason.value

    def tied_with_first(self) -> int:
        """`cluster.routing.ranking.tied_with_first` of this ranking, read from the committed blocks
        and prefixes (equal in both: equal keys) rather than from a RankedGroup per group."""
        order, committed, prefix, base = self.order, self._committed, self._prefix, self._base
        if not order:
            return 0
        first = order[0]
        blocks, held = committed[first], prefix.get(first, base)
        count = 1
        while (count < len(order) and committed[order[count]] == blocks
               and prefix.get(order[count], base) == held):
            count += 1
        return count

    def _placement(self, i: int) -> RankedGroup:
        prefix = self._prefix.get(i, self._base)
        occupancy = (self._committed[i] + self._num_blocks - prefix) / self._total
        tier = 2 if occupancy > FULL_OCCUPANCY else 0
        return RankedGroup(self._loads[i].group_id, reason_of(tier, occupancy, self._target, prefix),
                         occupancy, prefix)


def is_uniform(loads: Sequence[GroupLoad], max_report_age_s: float) -> bool:
    """Whether the compiled ranking can rank ``loads``: one pool size and block size, fresh reports."""
    return bool(loads) and (max(map(_AGE, loads)) <= max_report_age_s
                            and len(set(map(_TOTAL, loads))) == 1
                            and len(set(map(_BLOCK_SIZE, loads))) == 1)
