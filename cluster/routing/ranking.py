"""Where a request goes: the pure placement policy behind the KV-aware router.

    rank_groups(demand, loads, target_occupancy=0.70, prefix_weight=3, load_weight=2)
        -> [Placement, ...]   best group first

Data in, decision out: no Ray, no clock, no I/O, so the policy is tested on plain inputs and the
router (`cluster/routing/kv_router.py`) only turns Serve's routing stats into `GroupLoad`s and the ranking
back into replicas.

The policy, in rank order:

A request's demand on a group is its blocks (prompt plus expected output) less the leading
prompt blocks that group has cached (or was lately sent, see ``GroupLoad``): those take no new
block there. Projected occupancy = (the group's committed blocks + that demand) / its pool.

1. Fresh groups whose projected occupancy with the request stays at or under the target, and
   those holding a history of it (`is_history`: over half of the request's blocks past the base,
   below) whose pool still holds it (projected occupancy at most 1.0), by the highest score, then
   the lowest projected occupancy, then group id. The score is a weighted sum of a prefix score
   and a load score (as llm-d's scorers), each in [0, 1]:

       prefix_weight * (cached prefix blocks - base) / (the request's full blocks - base)
     + load_weight * (1 - projected occupancy / scale)
     + queue_weight * (1 - pending tokens / the most pending tokens of these groups)

   ``base`` is the fewest leading request blocks any fresh group holds: the prefix score counts
   only what tells the groups apart. Once every group has cached a shared system prompt, a
   conversation's next turn scores its history against the rest of the request, not against
   a whole that the system prompt pads: on the serving benchmark (README), counting the whole
   request let the load score take 2 of 3 next turns away from their history (5 and 9 cached
   blocks given up, the busier group at 0.09 and 0.42 projected occupancy against 0.01-0.02).
   The load score still places new conversations, whose only cached blocks are the base.

   ``scale`` is the highest projected occupancy of these groups (``load_scale="highest"``: the
   load relative to the busiest) or the occupancy target (``load_scale="target"``: the share of
   the headroom left, llm-d's absolute KV-usage score within the target). "highest" is the
   default: on the serving benchmark (README, 200 requests, same run) "target" kept more next
   turns on their busier group and ended with 31,795 / 51,138 prefill tokens per group against
   40,911 / 42,022, hit rate 0.832 against 0.844 (the busier group's cache evicts more) and
   TTFT p99 1,280 against 1,097 ms.
   Pending tokens are a group's compute backlog as the router knows it: its report's waiting
   tokens plus the tokens the router sent it since. ``queue_weight`` is 0 by default (README:
   the serving benchmark's runs with it).

   The weights are llm-d's profile (3 and 2): a cached prefix outweighs the load difference
   only while it is a large part of the request. With ``load_weight`` 0 this is the former
   strict order, longest cached prefix first and load only breaking ties. On the serving
   benchmark's KV-pressure workload (README) that order sent 88% and 99.7% of the prefill to one
   group in two of four runs: the first group to cache a shared system prompt always has the
   longer prefix, and stays under target while compute, not KV, is short. In the second of those
   runs its hit rate was 0.496 against the weighted score's 0.552 (one pool held what two
   could); over three same-run pairs the hit rates were 0.554/0.552, 0.554/0.518, 0.496/0.552
   and TTFT p99 differed both ways, within this host's noise.
2. The other fresh groups over the target whose pool still holds the request, by the same
   score with the load measured against the whole pool (``scale`` 1.0): the load scores differ
   by at most 2 x 0.3, so a group holding part of the request comes first, otherwise the least
   loaded. A prefix that is a small part of the request (a system prompt one busy group has
   cached) does not pull requests over the target: only a history does.
   Why a history's group over the target ranks with those under it (1.): on the serving
   benchmark at 3.5 req/s (README, 4 rounds paired with Serve's prefix-affinity router, which
   keeps a conversation home at any load), kept below the target's line, 28 of 800 decisions
   sent a next turn from its history's group just over the target to a group under it, giving
   up 1,260 cached blocks: hit rate 0.819 against 0.869 (paired -0.051 [-0.064, -0.038]). With
   the history ranked with them: 0.867 against 0.868 (-0.001 [-0.013, +0.012]), 163 blocks
   given up, TTFT p99 0.94x.
   (Before the cached prefix was subtracted from the demand, every group was charged the whole
   request, so the group holding a conversation looked as full as the others once both neared
   the target: on the serving benchmark's multi-turn workload, ``--min-turns 3 --seed 1``, 17 of
   80 decisions were "least loaded", each a coin toss for the history; hit rate 0.633 against
   Serve's prefix-affinity router's 0.812, TTFT p99 3.5 s against 2.0 s.)
3. Fresh groups whose pool does not hold the request (projected occupancy over 1.0), by the
   lowest projected occupancy, then group id: the least-loaded one takes the request (the
   engine queues or preempts there).
4. Groups whose report is stale (older than ``max_report_age_s``), by the same key as 3. A report
   that stopped arriving means the replica or its stats path is stuck, so its numbers are never
   trusted to show room; such a group stays a last resort rather than vanishing (Serve's own
   queue-length check still guards it).

Groups that tie on every key but the group id (idle groups with equal reports, asked to place a
new conversation) are told apart by the router, not here: it sends the request to the one of
them it gave the fewest tokens so far (`tied_with_first`, `cluster.routing.kv_router`). By group id
alone, every new conversation that came while the groups were idle went to the first group: on
the serving benchmark (README) 13 of 13 such decisions in two runs, 6-7 of about 38 new
conversations a run, one group's pool holding more histories than the other's.

Cost: O(G log G) for G groups, plus one set lookup per leading cached block, for fresh groups
only (a group that lacks the request's first block costs one lookup); given the groups' prefix
lengths (the router's `cluster.routing.prefix_index.PrefixIndex`), one dict lookup per group instead.
The scores add one pass over the groups of 1 and one over those of 2.
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
DEFAULT_QUEUE_WEIGHT = 0.0  # the pending-tokens score (llm-d's queue scorer); 0.0: off
# What a group's projected occupancy is divided by in the load score: "highest" (the highest of
# the under-target groups: relative load) or "target" (the occupancy target: headroom).
LOAD_SCALES = ("highest", "target")
DEFAULT_LOAD_SCALE = "highest"
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


class PlacementReason(str, enum.Enum):
    """Why a group holds its rank; the values are metric labels."""

    UNDER_TARGET_PREFIX = "under_target_prefix"  # fits under target and has part of the prefix
    UNDER_TARGET = "under_target"  # fits under target, nothing of the prefix cached
    OVER_TARGET_PREFIX = "over_target_prefix"  # over target, fits the pool, has part of the prefix
    OVER_TARGET = "over_target"  # over target, fits the pool, nothing of the prefix cached
    LEAST_LOADED = "least_loaded"  # over the pool: ranked by load alone
    STALE_REPORT = "stale_report"  # its report is too old to trust


class Placement(NamedTuple):
    """One ranked group. A tuple, not a dataclass: 64 of them per decision must stay cheap.

    ``cached_prefix_blocks`` is counted for fresh groups only (None for a stale one: its report
    is not trusted).
    """

    group_id: str
    reason: PlacementReason
    projected_occupancy: float
    cached_prefix_blocks: Optional[int]


def is_history(held: int, base: int, num_blocks: int) -> bool:
    """Whether a group holding ``held`` of a request's ``num_blocks`` blocks holds its history:
    over half of the blocks past ``base`` (the fewest any group holds). Such a group ranks with
    the groups under the target while its pool holds the request (module doc, 1.)."""
    return 2 * (held - base) > num_blocks - base


def tied_with_first(placements: Sequence[Placement]) -> int:
    """How many of the leading ``placements`` tie with the first: the same reason, projected
    occupancy and cached prefix blocks, so that ``rank_groups`` ordered them by group id alone
    (0 for no placements). Reads placements until the first that differs."""
    if not placements:
        return 0
    first = placements[0][1:]
    count = 1
    while count < len(placements) and placements[count][1:] == first:
        count += 1
    return count


def rank_groups(
    demand: RequestDemand,
    loads: Sequence[GroupLoad],
    target_occupancy: float = DEFAULT_TARGET_OCCUPANCY,
    max_report_age_s: float = DEFAULT_MAX_REPORT_AGE_S,
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
    load_weight: float = DEFAULT_LOAD_WEIGHT,
    cached_prefix: Optional[Mapping[str, int]] = None,
    queue_weight: float = DEFAULT_QUEUE_WEIGHT,
    load_scale: str = DEFAULT_LOAD_SCALE,
) -> List[Placement]:
    """Every group in ``loads``, best first, by the policy in this module's docstring.

    A group is under target when its projected occupancy is <= ``target_occupancy`` (exactly at
    the target counts as under). Returns [] for no groups: the caller falls back.
    ``cached_prefix``: each group's count of leading request blocks it holds, as
    `cluster.routing.prefix_index.PrefixIndex.prefix_blocks` finds them in one walk for all groups
    (groups left out hold none); None: each group's ``cached_block_hashes`` are scanned.
    """
    if not 0.0 < target_occupancy <= 1.0:
        raise ValueError(f"target_occupancy must be in (0, 1], got {target_occupancy}")
    if max_report_age_s <= 0:
        raise ValueError(f"max_report_age_s must be positive, got {max_report_age_s}")
    if not (prefix_weight >= 0 and load_weight >= 0 and queue_weight >= 0):
        raise ValueError(f"prefix_weight, load_weight and queue_weight must not be negative, got "
                         f"{prefix_weight}, {load_weight} and {queue_weight}")
    if load_scale not in LOAD_SCALES:
        raise ValueError(f"load_scale must be one of {', '.join(LOAD_SCALES)}, got {load_scale!r}")
    num_tokens = demand.num_tokens
    hashes, demand_bs = demand.block_hashes, demand.block_size
    num_hashes = len(hashes)
    first_hash = hashes[0] if hashes else None
    # [tier, -score, projected occupancy, group id, cached prefix blocks, pending tokens (0
    # without a queue weight)]; tier 0: fresh and under target, 1: fresh, over target, in the
    # pool, 2: fresh and over the pool, 3: stale. Scores are set once the under-target groups'
    # highest occupancy is known.
    entries: List[list] = []
    under: List[list] = []
    over: List[list] = []
    request_blocks: List[int] = []  # per entry: the request's blocks at its group's block size
    for load in loads:
        # GroupLoad.projected_occupancy, inlined: this loop is the router's per-request cost.
        num_blocks = -(-num_tokens // load.block_size)
        if load.report_age_s > max_report_age_s:
            occupancy = (load._num_blocks_committed + num_blocks) / load.num_blocks_total
            entries.append([3, 0.0, occupancy, load.group_id, None, 0])
            request_blocks.append(num_blocks)
            continue
        # GroupLoad.num_cached_prefix_blocks, inlined; a group that lacks the first block costs
        # one lookup.
        prefix = 0
        if first_hash is not None and load.block_size == demand_bs:
            if cached_prefix is not None:
                prefix = cached_prefix.get(load.group_id, 0)
            elif first_hash in load.cached_block_hashes:
                miss = next(filterfalse(load.cached_block_hashes.__contains__, hashes), None)
                prefix = num_hashes if miss is None else hashes.index(miss)
            if prefix > num_blocks:
                prefix = num_blocks
        occupancy = (load._num_blocks_committed + num_blocks - prefix) / load.num_blocks_total
        pending = (load.num_waiting_tokens + load.num_tokens_sent_since_report
                   if queue_weight else 0)
        entries.append([0, 0.0, occupancy, load.group_id, prefix, pending])
        request_blocks.append(num_blocks)
    if len({entry[3] for entry in entries}) != len(entries):
        raise ValueError("rank_groups: loads must have distinct group ids")
    # The prefix score counts what tells the groups apart: the blocks past the fewest any fresh
    # group holds (a shared system prompt every group has cached counts for none).
    base = min((entry[4] for entry in entries if entry[0] < 3), default=0)
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
    _score(under, num_hashes - base, prefix_weight, load_weight, queue_weight,
           target_occupancy if load_scale == "target" else None)
    _score(over, num_hashes - base, prefix_weight, load_weight, queue_weight, FULL_OCCUPANCY)
    # Stable sorts from the last key to the first: each sorts on one plain str, float or int,
    # which CPython compares several times faster than whole lists.
    for key in _SORT_KEYS:
        entries.sort(key=key)
    # Placement's own constructor is a Python-level call; tuple.__new__ (what namedtuple's
    # _make uses) builds the same object for a third of the cost, and this runs per group.
    new = tuple.__new__
    # A history's group over the target ranks with those under it but says where it is.
    return [
        new(Placement, (group_id, _REASONS[tier or occupancy > target_occupancy][bool(prefix)],
                        occupancy, prefix))
        for tier, _, occupancy, group_id, prefix, _ in entries
    ]


def _score(tier: List[list], num_blocks: int, prefix_weight: float, load_weight: float,
           queue_weight: float, scale: Optional[float]) -> None:
    """Sets the -score of each entry of one scored tier (see the module doc); ``num_blocks``:
    the request's full blocks past the fewest any fresh group holds; ``scale``: what occupancy
    is divided by (None: the highest of ``tier``)."""
    if not tier:
        return
    per_block = prefix_weight / num_blocks if num_blocks else 0.0
    highest = max(entry[2] for entry in tier) if scale is None else scale
    per_occupancy = load_weight / highest if highest > 0 else 0.0
    longest = max(entry[5] for entry in tier) if queue_weight else 0
    per_pending = queue_weight / longest if longest > 0 else 0.0
    for entry in tier:
        entry[1] = (per_occupancy * entry[2] + per_pending * entry[5] - per_block * entry[4]
                    - load_weight - queue_weight)


_SORT_KEYS = (itemgetter(3), itemgetter(2), itemgetter(1), itemgetter(0))
# _REASONS[tier][has cached prefix]
_REASONS = (
    (PlacementReason.UNDER_TARGET, PlacementReason.UNDER_TARGET_PREFIX),
    (PlacementReason.OVER_TARGET, PlacementReason.OVER_TARGET_PREFIX),
    (PlacementReason.LEAST_LOADED, PlacementReason.LEAST_LOADED),
    (PlacementReason.STALE_REPORT, PlacementReason.STALE_REPORT),
)
