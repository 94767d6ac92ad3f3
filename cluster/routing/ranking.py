"""Where a request goes: the one ranking policy of the KV-aware router.

    rank_groups(demand, loads, target_occupancy=0.70, prefix_weight=3, load_weight=2)
        -> [RankedGroup, ...]   best group first

Data in, decision out: no Ray, no clock, no I/O. The router (`cluster.routing.kv_router`) only
turns Serve's routing stats into `GroupLoad`s and the ranking back into replicas; its compiled
fast path (`cluster.routing.native_rank`) is checked against this function on generated fleets.
The evidence behind each rule is in docs/benchmarks/routing-policy.md.

A request's demand on a group is its blocks (prompt plus expected output) less the leading
prompt blocks that group has cached (or was lately sent, see ``GroupLoad``): those take no new
block there. Projected occupancy = (the group's committed blocks + that demand) / its pool.
``base`` is the fewest leading request blocks any fresh group holds (a system prompt every group
caches counts for none). The policy, in rank order:

1. Fresh groups whose projected occupancy stays at or under the target, and those holding the
   request's history (`is_history`: over half of its blocks past ``base``) while their pool
   holds the request (projected occupancy at most 1.0): by the highest score, then the lowest
   projected occupancy, then group id. The score, each term in [0, 1]:

       prefix_weight * (cached prefix blocks - base) / (the request's full blocks - base)
     + load_weight * (1 - projected occupancy / the highest projected occupancy of these groups)

   With ``load_weight`` 0 this is the strict order: longest cached prefix first, load only
   breaking ties.
2. The other fresh groups whose pool still holds the request: the same score, the load measured
   against the whole pool. A small cached prefix does not pull a request over the target; only
   a history does.
3. Fresh groups whose pool does not hold the request: the least projected occupancy first.
4. Groups whose report is older than ``max_report_age_s``, by the same key as 3: never trusted to
   show room, but a last resort rather than gone.

Groups that tie on every key but the group id are told apart by the router, which sends the
request to the one it gave the fewest tokens (`tied_with_first`).

Cost: O(G log G) for G groups; given the groups' prefix lengths (the router's
`cluster.routing.prefix_index.PrefixIndex`) one dict lookup per group, else one set lookup per
leading cached block of each fresh group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import itemgetter
from typing import AbstractSet, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from kv.prefix_hash import BlockHash

DEFAULT_TARGET_OCCUPANCY = 0.70
DEFAULT_MAX_REPORT_AGE_S = 5.0
DEFAULT_PREFIX_WEIGHT = 3.0
DEFAULT_LOAD_WEIGHT = 2.0  # with prefix 3.0, llm-d's profile; 0.0: the strict prefix order
FULL_OCCUPANCY = 1.0  # a pool with all its blocks committed: past it the request does not fit


def _num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class GroupLoad:
    """One TP group's KV load: its replica's last report plus what the router sent it since.

    Fields from the report: ``num_blocks_used`` / ``num_blocks_total`` / ``block_size`` of its KV
    pool, ``num_waiting_tokens`` (tokens of accepted requests not yet holding blocks),
    ``cached_block_hashes`` (chained hashes of its cached full blocks, `kv.prefix_hash`),
    ``report_seq`` and ``report_age_s`` (how old the report was when the router read it). Added by
    the router: ``num_tokens_sent_since_report`` (tokens of requests it routed to the group after
    the report was taken). The router may add to ``cached_block_hashes`` the hashes of prompts it
    sent the group lately (``ReplicaLoadTracker``): a conversation's next turn can arrive before
    the report that lists the turn before it.
    """

    group_id: str
    num_blocks_used: int
    num_blocks_total: int
    block_size: int
    num_waiting_tokens: int
    cached_block_hashes: AbstractSet[BlockHash]
    report_seq: int
    report_age_s: float
    num_tokens_sent_since_report: int = 0
    _num_blocks_committed: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not self.group_id:
            raise ValueError("GroupLoad.group_id must be a non-empty string")
        if self.num_blocks_total <= 0:
            raise ValueError(
                f"group {self.group_id}: num_blocks_total must be positive, "
                f"got {self.num_blocks_total}"
            )
        if not 0 <= self.num_blocks_used <= self.num_blocks_total:
            raise ValueError(
                f"group {self.group_id}: num_blocks_used must be in [0, num_blocks_total="
                f"{self.num_blocks_total}], got {self.num_blocks_used}"
            )
        if self.block_size <= 0:
            raise ValueError(
                f"group {self.group_id}: block_size must be positive, got {self.block_size}"
            )
        if self.num_waiting_tokens < 0 or self.num_tokens_sent_since_report < 0:
            raise ValueError(
                f"group {self.group_id}: token counts must not be negative, got waiting="
                f"{self.num_waiting_tokens}, sent={self.num_tokens_sent_since_report}"
            )
        if not self.report_age_s >= 0:  # also refuses NaN
            raise ValueError(
                f"group {self.group_id}: report_age_s must not be negative, "
                f"got {self.report_age_s}"
            )
        # Everything but the new request, in blocks: computed once, read per decision.
        committed = (
            self.num_blocks_used
            + _num_blocks(self.num_waiting_tokens, self.block_size)
            + _num_blocks(self.num_tokens_sent_since_report, self.block_size)
        )
        object.__setattr__(self, "_num_blocks_committed", committed)

    def projected_occupancy(self, num_tokens: int, num_cached_blocks: int = 0) -> float:
        """Fraction of the pool in use once a request of ``num_tokens`` tokens is added, of which
        the first ``num_cached_blocks`` blocks are cached here already (they take no new block):

            (used + ceil(waiting / bs) + ceil(sent / bs) + ceil(num_tokens / bs) - cached) / total

        with bs the block size; each term is rounded up to whole blocks on its own, so the
        estimate errs on the full side. May exceed 1.0 (the group is oversubscribed).
        """
        num_blocks = _num_blocks(num_tokens, self.block_size)
        return (self._num_blocks_committed + num_blocks - min(num_cached_blocks, num_blocks)) / (
            self.num_blocks_total
        )

    def num_cached_prefix_blocks(self, demand: "RequestDemand") -> int:
        """Count of leading ``demand.block_hashes`` this group has cached (up to the first miss).

        0 when the block sizes differ (the hashes would cover other token spans). One set lookup
        per cached leading block plus one for the miss, done in C.
        """
        block_hashes = demand.block_hashes
        cached = self.cached_block_hashes
        if not block_hashes or self.block_size != demand.block_size:
            return 0
        if block_hashes[0] not in cached:
            return 0
        first_miss = next(filterfalse(cached.__contains__, block_hashes), None)
        # index() finds the first occurrence of the missed hash, which is where the scan stopped
        # (an earlier occurrence would have missed first).
        return len(block_hashes) if first_miss is None else block_hashes.index(first_miss)


@dataclass(frozen=True)
class RequestDemand:
    """What a request needs: ``num_tokens`` (prompt plus expected output) and the chained hashes
    of its full prompt blocks (`kv.prefix_hash.extend_block_hashes`) at ``block_size`` tokens a
    block. Prefix affinity only counts for groups whose block size equals ``block_size``; without
    hashes the request has no affinity."""

    num_tokens: int
    block_hashes: Tuple[BlockHash, ...] = ()
    block_size: Optional[int] = None  # required with block_hashes

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(
                f"RequestDemand.num_tokens must be a non-negative integer, got {self.num_tokens!r}"
            )
        if self.block_hashes and self.block_size is None:
            raise ValueError("RequestDemand.block_size is required when block_hashes are given")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"RequestDemand.block_size must be positive, got {self.block_size}")


class RankReason(str, enum.Enum):
    """Why a group holds its rank; the values are metric labels."""

    UNDER_TARGET_PREFIX = "under_target_prefix"  # fits under target and has part of the prefix
    UNDER_TARGET = "under_target"  # fits under target, nothing of the prefix cached
    OVER_TARGET_PREFIX = "over_target_prefix"  # over target, fits the pool, has part of the prefix
    OVER_TARGET = "over_target"  # over target, fits the pool, nothing of the prefix cached
    LEAST_LOADED = "least_loaded"  # over the pool: ranked by load alone
    STALE_REPORT = "stale_report"  # its report is too old to trust


class RankedGroup(NamedTuple):
    """One ranked group. A tuple, not a dataclass: 64 of them per decision must stay cheap.

    ``cached_prefix_blocks`` is counted for fresh groups only (None for a stale one: its report
    is not trusted).
    """

    group_id: str
    reason: RankReason
    projected_occupancy: float
    cached_prefix_blocks: Optional[int]


def is_history(held: int, base: int, num_blocks: int) -> bool:
    """Whether a group holding ``held`` of a request's ``num_blocks`` blocks holds its history:
    over half of the blocks past ``base`` (the fewest any group holds). Such a group ranks with
    the groups under the target while its pool holds the request (module doc, 1.)."""
    return 2 * (held - base) > num_blocks - base


def tied_with_first(ranked: Sequence[RankedGroup]) -> int:
    """How many of the leading ``ranked`` tie with the first: the same reason, projected
    occupancy and cached prefix blocks, so that ``rank_groups`` ordered them by group id alone
    (0 for no ranked). Reads ranked until the first that differs."""
    if not ranked:
        return 0
    first = ranked[0][1:]
    count = 1
    while count < len(ranked) and ranked[count][1:] == first:
        count += 1
    return count


def check_policy(target_occupancy: float, max_report_age_s: float, prefix_weight: float,
                 load_weight: float) -> None:
    """Raises ValueError naming the first setting of the policy out of its range."""
    if not 0.0 < target_occupancy <= 1.0:
        raise ValueError(f"target_occupancy must be in (0, 1], got {target_occupancy}")
    if max_report_age_s <= 0:
        raise ValueError(f"max_report_age_s must be positive, got {max_report_age_s}")
    if not (prefix_weight >= 0 and load_weight >= 0):
        raise ValueError(f"prefix_weight and load_weight must not be negative, got "
                         f"{prefix_weight} and {load_weight}")


def reason_of(tier: int, occupancy: float, target_occupancy: float,
              prefix: Optional[int]) -> RankReason:
    """The reason a group ranked in ``tier`` (0-3, the policy's items 1-4) gives: a history's
    group over the target ranks with those under it but says where it is."""
    return _REASONS[tier or occupancy > target_occupancy][bool(prefix)]


def rank_groups(
    demand: RequestDemand,
    loads: Sequence[GroupLoad],
    target_occupancy: float = DEFAULT_TARGET_OCCUPANCY,
    max_report_age_s: float = DEFAULT_MAX_REPORT_AGE_S,
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
    load_weight: float = DEFAULT_LOAD_WEIGHT,
    cached_prefix: Optional[Mapping[str, int]] = None,
) -> List[RankedGroup]:
    """Every group in ``loads``, best first, by the policy in this module's docstring.

    A group is under target when its projected occupancy is <= ``target_occupancy`` (exactly at
    the target counts as under). Returns [] for no groups: the caller falls back.
    ``cached_prefix``: each group's count of leading request blocks it holds, as
    `cluster.routing.prefix_index.PrefixIndex.prefix_blocks` finds them in one walk for all groups
    (groups left out hold none); None: each group's ``cached_block_hashes`` are scanned.
    """
    check_policy(target_occupancy, max_report_age_s, prefix_weight, load_weight)
    entries, request_blocks = _entries(demand, loads, max_report_age_s, cached_prefix)
    # The prefix score counts what tells the groups apart: the blocks past the fewest any fresh
    # group holds.
    base = min((entry[4] for entry in entries if entry[0] < 3), default=0)
    under, over = _tiers(entries, request_blocks, base, target_occupancy)
    num_blocks_past_base = len(demand.block_hashes) - base
    _score(under, num_blocks_past_base, prefix_weight, load_weight, None)
    _score(over, num_blocks_past_base, prefix_weight, load_weight, FULL_OCCUPANCY)
    # Stable sorts from the last key to the first: each sorts on one plain str, float or int,
    # which CPython compares several times faster than whole lists.
    for key in _SORT_KEYS:
        entries.sort(key=key)
    # tuple.__new__ (what namedtuple's _make uses) builds a RankedGroup for a third of the cost of
    # its constructor, and this runs per group.
    new = tuple.__new__
    return [new(RankedGroup, (group_id, _REASONS[tier or occupancy > target_occupancy][bool(prefix)],
                            occupancy, prefix))
            for tier, _, occupancy, group_id, prefix in entries]


def _entries(demand: RequestDemand, loads: Sequence[GroupLoad], max_report_age_s: float,
             cached_prefix: Optional[Mapping[str, int]]) -> Tuple[List[list], List[int]]:
    """Per group ``[tier, -score, projected occupancy, group id, cached prefix blocks]`` (tier 0
    for every fresh group until `_tiers` places it, 3 for a stale one, whose prefix is None), and
    per group the request's blocks at its block size."""
    num_tokens = demand.num_tokens
    hashes, demand_bs = demand.block_hashes, demand.block_size
    first_hash = hashes[0] if hashes else None
    entries: List[list] = []
    request_blocks: List[int] = []
    for load in loads:
        # GroupLoad.projected_occupancy, inlined: this loop is the router's per-request cost.
        num_blocks = -(-num_tokens // load.block_size)
        request_blocks.append(num_blocks)
        if load.report_age_s > max_report_age_s:
            occupancy = (load._num_blocks_committed + num_blocks) / load.num_blocks_total
            entries.append([3, 0.0, occupancy, load.group_id, None])
            continue
        prefix = 0
        if first_hash is not None and load.block_size == demand_bs:
            if cached_prefix is not None:
                prefix = cached_prefix.get(load.group_id, 0)
            elif first_hash in load.cached_block_hashes:  # a group lacking it costs one lookup
                prefix = load.num_cached_prefix_blocks(demand)
            prefix = min(prefix, num_blocks)
        occupancy = (load._num_blocks_committed + num_blocks - prefix) / load.num_blocks_total
        entries.append([0, 0.0, occupancy, load.group_id, prefix])
    if len({entry[3] for entry in entries}) != len(entries):
        raise ValueError("rank_groups: loads must have distinct group ids")
    return entries, request_blocks


def _tiers(entries: List[list], request_blocks: List[int], base: int,
           target_occupancy: float) -> Tuple[List[list], List[list]]:
    """Sets each fresh entry's tier (0: under the target or a history in its pool, 1: over the
    target in the pool, 2: over the pool) and returns the entries of tiers 0 and 1."""
    under: List[list] = []
    over: List[list] = []
    for entry, num_blocks in zip(entries, request_blocks):
        if entry[0] == 3:
            continue
        occupancy = entry[2]
        if occupancy <= target_occupancy or (occupancy <= FULL_OCCUPANCY
                                             and is_history(entry[4], base, num_blocks)):
            under.append(entry)
        elif occupancy <= FULL_OCCUPANCY:
            entry[0] = 1
            over.append(entry)
        else:
            entry[0] = 2
    return under, over


def _score(tier: List[list], num_blocks: int, prefix_weight: float, load_weight: float,
           scale: Optional[float]) -> None:
    """Sets the -score of each entry of one scored tier (see the module doc); ``num_blocks``:
    the request's full blocks past the fewest any fresh group holds; ``scale``: what occupancy
    is divided by (None: the highest of ``tier``)."""
    if not tier:
        return
    per_block = prefix_weight / num_blocks if num_blocks else 0.0
    highest = max(entry[2] for entry in tier) if scale is None else scale
    per_occupancy = load_weight / highest if highest > 0 else 0.0
    for entry in tier:
        entry[1] = per_occupancy * entry[2] - per_block * entry[4] - load_weight


_SORT_KEYS = (itemgetter(3), itemgetter(2), itemgetter(1), itemgetter(0))
# _REASONS[tier][has cached prefix]
_REASONS = (
    (RankReason.UNDER_TARGET, RankReason.UNDER_TARGET_PREFIX),
    (RankReason.OVER_TARGET, RankReason.OVER_TARGET_PREFIX),
    (RankReason.LEAST_LOADED, RankReason.LEAST_LOADED),
    (RankReason.STALE_REPORT, RankReason.STALE_REPORT),
)
