"""`rank_groups`' ranking without a Python pass over every group, for the router's usual fleet.

`cluster.routing.ranking.rank_groups` builds, scores and sorts an entry per group: with 64 groups that
is most of a routing decision (30 us of about 45 in `scripts/bench_router.py`, hot). Its order
has a shape that needs far less work when every group reports a pool of the same size and block
size, every report is fresh and the queue score is off (``queue_weight`` 0):

* A group's key is (tier, -score, projected occupancy, group id). Groups that hold the same
  number of the request's leading blocks differ in their key only through their committed blocks
  (the occupancy, the tier and the load score grow with them); so among the groups holding the
  *base* prefix (the fewest leading blocks any group holds: 0, or a system prompt every group
  caches), the ranking is their order by committed blocks, then group id: under-target ones
  first, then those over the target that hold the request, then the rest.
* Only the groups that hold more than the base (a conversation's own history: a few) need a
  score of their own (a history, `cluster.routing.ranking.is_history`, is scored as under the target
  while its pool holds the request); each is inserted into that order by binary search.

That order does not depend on the request, so it is kept between decisions (`CommittedOrder`,
one per `cluster.routing.load_report.FleetLoads`, moved one group at a time as charges change it): a
decision copies it and computes keys for the longer-prefix groups and O(log G) others, given the
base and those groups (`PrefixIndex.prefix_split`: one walk that names only the groups outlasting
the base). Why kept, not sorted per decision: a decision runs between engine steps with cold
caches, where reading every group's load for a sort cost more than the whole rest of the ranking
(docs/benchmarks/routing-policy.md#speed, ``scripts/bench_router.py``).

Scores are the same floating-point expressions as `rank_groups`' (a test checks the two rankings
are equal on generated fleets); outside those conditions (``is_uniform``) the caller ranks with
`rank_groups`. The result is `UniformRanking`, a sequence of the same `Placement`s, built only
for the positions read (the router reads the first, and the group that accepts).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from operator import attrgetter
from typing import Dict, Iterator, List, Mapping, Sequence, Tuple

from cluster.routing.ranking import (_REASONS, FULL_OCCUPANCY, GroupLoad, Placement, RequestDemand,
                               is_history)

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


class UniformRanking(Sequence[Placement]):
    """``rank_groups``' result for a uniform fleet: ``order[k]`` is the index (into the loads) of
    the group ranked k-th, and item k its `Placement`, made when read."""

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

    def __iter__(self) -> Iterator[Placement]:
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
        and prefixes (equal in both: equal keys) rather than from a Placement per group."""
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

    def _placement(self, i: int) -> Placement:
        prefix = self._prefix.get(i, self._base)
        occupancy = (self._committed[i] + self._num_blocks - prefix) / self._total
        tier = 0 if occupancy <= self._target else 1 if occupancy <= FULL_OCCUPANCY else 2
        return Placement(self._loads[i].group_id, _REASONS[tier][bool(prefix)], occupancy, prefix)


def rank_uniform(
    demand: RequestDemand,
    loads: Sequence[GroupLoad],
    kept: CommittedOrder,
    base: int,
    longer: Mapping[int, int],
    target_occupancy: float,
    prefix_weight: float,
    load_weight: float,
    load_scale: str,
) -> UniformRanking:
    """``rank_groups(demand, loads, ...)`` with ``queue_weight`` 0, for a uniform fleet of fresh
    reports (the caller checks: `is_uniform`), whose committed blocks ``kept`` holds (not the
    loads': the router moves ``kept`` with each charge). ``base``: the fewest leading request
    blocks any group holds; ``longer``: index -> blocks held, for the groups holding more (as
    `PrefixIndex.prefix_split` finds them).

    One function on purpose, with the few keys it needs inlined: a decision runs with cold
    caches, where each function called costs a fetch of its code (module doc)."""
    total = loads[0].num_blocks_total
    num_blocks = -(-demand.num_tokens // loads[0].block_size)
    num_hashes = len(demand.block_hashes)
    if not num_hashes or demand.block_size != loads[0].block_size:
        base, longer = 0, {}  # no affinity (rank_groups counts a prefix at the same size only)
    base = min(base, num_blocks)
    prefix: Dict[int, int] = {}  # loops, not comprehensions: each is a function of its own
    for i, held in longer.items():
        if min(held, num_blocks) > base:
            prefix[i] = min(held, num_blocks)
    committed = kept.committed.copy()  # the placements are read again after later charges
    order = kept.order.copy()
    target = target_occupancy
    if not prefix:  # the kept order is the ranking (every key grows with committed blocks)
        return UniformRanking(order, loads, committed, prefix, base, num_blocks, target)
    for i in prefix:
        order.remove(i)
    # How many of the base-prefix groups are under target: a prefix of order (occupancy grows
    # along it), found by binary search with rank_groups' own expression.
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if (committed[order[mid]] + num_blocks - base) / total <= target:
            lo = mid + 1
        else:
            hi = mid
    if load_scale == "target":
        highest = target
    else:  # the highest projected occupancy under target, as rank_groups' _score takes it
        highest = (committed[order[lo - 1]] + num_blocks - base) / total if lo else 0.0
        for i, held in prefix.items():  # a history is scored up to a full pool
            occupancy = (committed[i] + num_blocks - held) / total
            ceiling = FULL_OCCUPANCY if is_history(held, base, num_blocks) else target
            if highest < occupancy <= ceiling:
                highest = occupancy
    per_block = prefix_weight / (num_hashes - base) if num_hashes > base else 0.0
    per_occupancy = load_weight / highest if highest > 0 else 0.0
    per_occupancy_over = load_weight / FULL_OCCUPANCY  # over the target: the whole pool's share

    def key(i: int, held: int) -> Tuple[int, float, float, str]:  # rank_groups' sort key
        occupancy = (committed[i] + num_blocks - held) / total
        if occupancy > FULL_OCCUPANCY:
            return 2, 0.0, occupancy, loads[i].group_id
        # a history is scored as under the target while its pool holds the request
        over = occupancy > target and not is_history(held, base, num_blocks)
        scale = per_occupancy_over if over else per_occupancy
        # _score's expression, with the queue term (0.0 * 0) in place
        score = scale * occupancy + 0.0 * 0 - per_block * held - load_weight - 0.0
        return int(over), score, occupancy, loads[i].group_id

    # Insert each longer-prefix group (in key order) into order by binary search.
    keyed = []
    for i, held in prefix.items():
        keyed.append((key(i, held), i))
    keyed.sort()
    merged: List[int] = []
    start = 0
    for own, i in keyed:
        lo, hi = start, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            if key(order[mid], base) < own:
                lo = mid + 1
            else:
                hi = mid
        merged += order[start:lo]
        merged.append(i)
        start = lo
    merged += order[start:]
    return UniformRanking(merged, loads, committed, prefix, base, num_blocks, target)


def is_uniform(loads: Sequence[GroupLoad], max_report_age_s: float) -> bool:
    """Whether ``rank_uniform`` ranks ``loads``: one pool size and block size, fresh reports."""
    return bool(loads) and (max(map(_AGE, loads)) <= max_report_age_s
                            and len(set(map(_TOTAL, loads))) == 1
                            and len(set(map(_BLOCK_SIZE, loads))) == 1)
