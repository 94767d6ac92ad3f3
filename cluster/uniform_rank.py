"""`rank_groups`' ranking without a Python pass over every group, for the router's usual fleet.

`cluster.placement.rank_groups` builds, scores and sorts an entry per group: with 64 groups that
is most of a routing decision (30 us of about 45 in `scripts/bench_router.py`, hot). Its order
has a shape that needs far less work when every group reports a pool of the same size and block
size, every report is fresh and the queue score is off (``queue_weight`` 0):

* A group's key is (tier, -score, projected occupancy, group id). Groups that hold the same
  number of the request's leading blocks differ in their key only through their committed blocks
  (the occupancy, and the load score, grow with them); so among the groups holding the *base*
  prefix (the fewest leading blocks any group holds: 0, or a system prompt every group caches),
  the ranking is their order by committed blocks, then group id: under-target ones first.
* Only the groups that hold more than the base (a conversation's own history: a few) need a
  score of their own; each is inserted into that order by binary search.

So a decision costs one C-level sort of the group indices by committed blocks and O(log G) key
computations per longer-prefix group, given the base and those groups
(`PrefixIndex.prefix_split`: one walk that names only the groups outlasting the base). Scores are the
same floating-point expressions as `rank_groups`' (a test checks the two rankings are equal on
generated fleets); outside those conditions (``is_uniform``) the caller ranks with
`rank_groups`. The result is `UniformRanking`, a sequence of the same `Placement`s, built only
for the positions read (the router reads the first, and the group that accepts).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Dict, Iterator, List, Mapping, Sequence, Tuple

from cluster.placement import _REASONS, GroupLoad, Placement, RequestDemand

_COMMITTED = attrgetter("_num_blocks_committed")
_TOTAL = attrgetter("num_blocks_total")
_BLOCK_SIZE = attrgetter("block_size")
_AGE = attrgetter("report_age_s")


class UniformRanking(Sequence[Placement]):
    """``rank_groups``' result for a uniform fleet: ``order[k]`` is the index (into the loads) of
    the group ranked k-th, and item k its `Placement`, made when read."""

    __slots__ = ("order", "_loads", "_committed", "_prefix", "_num_blocks", "_total", "_target")

    def __init__(self, order: List[int], loads: Sequence[GroupLoad], committed: List[int],
                 prefix: Dict[int, int], num_blocks: int, target: float) -> None:
        self.order = order
        self._loads, self._committed, self._prefix = loads, committed, prefix
        self._num_blocks, self._total, self._target = num_blocks, loads[0].num_blocks_total, target

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self._placement(i) for i in self.order[k]]
        return self._placement(self.order[k])

    def __iter__(self) -> Iterator[Placement]:
        return map(self._placement, self.order)

    def _placement(self, i: int) -> Placement:
        prefix = self._prefix[i]
        occupancy = (self._committed[i] + self._num_blocks - prefix) / self._total
        tier = 0 if occupancy <= self._target else 1
        return Placement(self._loads[i].group_id, _REASONS[tier][bool(prefix)], occupancy, prefix)


def rank_uniform(
    demand: RequestDemand,
    loads: Sequence[GroupLoad],
    gid_order: Sequence[int],
    base: int,
    longer: Mapping[int, int],
    target_occupancy: float,
    prefix_weight: float,
    load_weight: float,
    load_scale: str,
) -> UniformRanking:
    """``rank_groups(demand, loads, ...)`` with ``queue_weight`` 0, for a uniform fleet of fresh
    reports (the caller checks: `is_uniform`). ``gid_order``: the indices of ``loads`` by group id; ``base``: the fewest leading request
    blocks any group holds; ``longer``: index -> blocks held, for the groups holding more (as
    `PrefixIndex.prefix_split` finds them)."""
    num_blocks = -(-demand.num_tokens // loads[0].block_size)
    if not demand.block_hashes or demand.block_size != loads[0].block_size:
        base, longer = 0, {}  # no affinity (rank_groups counts a prefix at the same size only)
    base = min(base, num_blocks)
    prefix = _Base(base)
    for i, held in longer.items():
        if min(held, num_blocks) > base:
            prefix[i] = min(held, num_blocks)
    committed = list(map(_COMMITTED, loads))  # read now: the loads change with every charge
    order = sorted(gid_order, key=committed.__getitem__)  # stable: ties stay by group id
    for i in prefix:
        order.remove(i)
    key = _Keys(loads, committed, num_blocks, target_occupancy, prefix_weight,
                len(demand.block_hashes), load_weight)
    num_under = _count_under(order, key, base)
    if load_scale == "target":
        highest = target_occupancy
    else:  # the highest projected occupancy under target, as rank_groups' _score takes it
        occupancies = [key.occupancy(i, held) for i, held in prefix.items()]
        occupancies.append(key.occupancy(order[num_under - 1], base) if num_under else 0.0)
        highest = max(o for o in occupancies if o <= target_occupancy)
    key.set_highest(highest)
    longer_sorted = sorted(prefix, key=lambda i: key(i, prefix[i]))
    return UniformRanking(_merge(order, longer_sorted, key, base, prefix), loads, committed,
                          prefix, num_blocks, target_occupancy)


def is_uniform(loads: Sequence[GroupLoad], max_report_age_s: float) -> bool:
    """Whether ``rank_uniform`` ranks ``loads``: one pool size and block size, fresh reports."""
    return bool(loads) and (max(map(_AGE, loads)) <= max_report_age_s
                            and len(set(map(_TOTAL, loads))) == 1
                            and len(set(map(_BLOCK_SIZE, loads))) == 1)


class _Base(dict):
    """index -> prefix blocks; any index not set holds the base prefix."""

    __slots__ = ("base",)

    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, i: int) -> int:
        return self.base


class _Keys:
    """`rank_groups`' sort key of group ``i`` with ``prefix`` blocks, by the same expressions."""

    __slots__ = ("loads", "committed", "num_blocks", "total", "target", "per_block",
                 "load_weight", "per_occupancy")

    def __init__(self, loads: Sequence[GroupLoad], committed: List[int], num_blocks: int,
                 target: float, prefix_weight: float, num_hashes: int,
                 load_weight: float) -> None:
        self.loads, self.committed, self.num_blocks = loads, committed, num_blocks
        self.total, self.target = loads[0].num_blocks_total, target
        self.per_block = prefix_weight / num_hashes if num_hashes else 0.0
        self.load_weight = load_weight
        self.per_occupancy = 0.0

    def set_highest(self, highest: float) -> None:
        self.per_occupancy = self.load_weight / highest if highest > 0 else 0.0

    def occupancy(self, i: int, prefix: int) -> float:
        return (self.committed[i] + self.num_blocks - prefix) / self.total

    def __call__(self, i: int, prefix: int) -> Tuple[int, float, float, str]:
        occupancy = self.occupancy(i, prefix)
        if occupancy > self.target:
            return 1, 0.0, occupancy, self.loads[i].group_id
        # _score's expression, with the queue term (0.0 * 0) in place
        score = (self.per_occupancy * occupancy + 0.0 * 0 - self.per_block * prefix
                 - self.load_weight - 0.0)
        return 0, score, occupancy, self.loads[i].group_id


def _count_under(order: List[int], key: _Keys, base: int) -> int:
    """How many of ``order`` (base-prefix groups by committed blocks) are under target."""
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if key.occupancy(order[mid], base) <= key.target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _merge(order: List[int], longer: List[int], key: _Keys, base: int,
           prefix: Mapping[int, int]) -> List[int]:
    """``order`` (sorted by key) with each of ``longer`` (sorted by key) inserted in its place."""
    if not longer:
        return order
    merged: List[int] = []
    start = 0
    for i in longer:
        target = key(i, prefix[i])
        lo, hi = start, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            if key(order[mid], base) < target:
                lo = mid + 1
            else:
                hi = mid
        merged += order[start:lo]
        merged.append(i)
        start = lo
    merged += order[start:]
    return merged
