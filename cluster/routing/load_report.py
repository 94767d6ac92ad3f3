"""What the KV-aware router knows of one group: its load reports (`cluster.contract.LoadReport`,
which says what each field means), parsed, plus what the router sent it since
(`cluster.routing.kv_router` describes the accounting). No Ray here: everything takes the
routing-stats dicts Serve hands over and this router's clock, so it is tested on plain inputs.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from cluster.contract import LoadReport
from cluster.routing.ranking import DEFAULT_MAX_REPORT_AGE_S, GroupLoad
from cluster.routing.prefix_index import PrefixIndex
from cluster.routing.fleet_order import CommittedOrder, is_uniform
from kv.prefix_hash import BlockHash

logger = logging.getLogger(__name__)

# A cached GroupLoad is rebuilt when its report age is this much out of date (or when a report or
# a charge changes it). The age only decides staleness against limits of seconds; rebuilding all
# loads more often would cost more than the ranking itself.
LOAD_AGE_REFRESH_S = 0.5
# Block hashes of routed prompts a tracker counts as cached until its TTL (a bound on memory).
MAX_ROUTED_HASHES = 65536


class ReplicaLoadTracker:
    """One replica's load as this router knows it: its last report plus what was sent since.

    No Ray in here: ``observe`` takes the stats dict and this router's time, so it is tested on
    plain inputs. Costs: O(hashes + listed ids) once per new report, O(1) amortized per decision
    and per charge.

    With an ``index``, every hash counted as cached here is in it under this group's bit too
    (`PrefixIndex`: the router's prefix lookups for all groups at once); ``close`` takes them out.
    ``on_change(group_id)`` is called whenever the load changes otherwise than by ageing (a
    report, a charge, a release, a routed prompt), so that a caller may keep loads between calls.
    """

    def __init__(self, group_id: str, charge_ttl_s: float = 2 * DEFAULT_MAX_REPORT_AGE_S,
                 index: Optional[PrefixIndex] = None,
                 on_change: Optional[Callable[[str], None]] = None) -> None:
        self.group_id = group_id
        self.charge_ttl_s = charge_ttl_s
        self._on_change = on_change
        self._index = index
        self._bit = index.add_group(group_id) if index is not None else 0
        self._report: Optional[LoadReport] = None
        self._received_at = 0.0  # this router's time when the report's seq was first seen
        self._stats: Optional[Mapping[str, Any]] = None  # the stats dict last looked at
        # (seq,) of the last report taken or refused (a refused one is logged once).
        self._seen: Optional[Tuple[Any]] = None
        # request id -> (time charged, tokens), oldest first.
        self._charges: "collections.OrderedDict[str, Tuple[float, int]]" = (
            collections.OrderedDict()
        )
        self.num_tokens_sent = 0
        # Tokens of every request this group accepted from this router, less the cached prefix
        # they were ranked with (never decreases): the router gives exact ties to the least.
        self.num_tokens_accepted = 0
        # Block hashes of prompts routed here -> when, oldest first: counted as cached for
        # charge_ttl_s, whatever the reports say (a report lists a prompt's blocks only once
        # the group has computed them, seconds after a follow-up may need to know).
        self._routed: "collections.OrderedDict[BlockHash, float]" = collections.OrderedDict()
        # The last report's hashes and the routed ones: what the index holds under this group's
        # bit (kept here to update it by difference), and GroupLoad.cached_block_hashes.
        self._held: Set[BlockHash] = set()
        self._load: Optional[GroupLoad] = None
        self._load_built_at = 0.0

    @property
    def bit(self) -> int:
        """This group's bit in the prefix index (0 without one)."""
        return self._bit

    def observe(self, stats: Optional[Mapping[str, Any]], now: float) -> Optional[GroupLoad]:
        """The group's load at ``now`` given the replica's current stats; None without a report."""
        # Serve hands over a new dict with each update, so the same dict needs no second look.
        if stats is not self._stats:
            self._stats = stats
            if stats and (LoadReport.seq_of(stats),) != self._seen:
                self._take_report(stats, now)
        if self._report is None:
            return None
        if self._load is None or now - self._load_built_at > LOAD_AGE_REFRESH_S:
            self._load = self._build_load(self._report, now)
            self._load_built_at = now
        return self._load

    def committed_blocks(self) -> int:
        """``GroupLoad._num_blocks_committed`` of the load now, without building one (the router
        moves a uniform fleet's `CommittedOrder` with it on every charge); needs a report."""
        report = self._report
        assert report is not None, "committed_blocks() needs a report"
        size = report.block_size
        return (report.num_blocks_used + -(-report.num_waiting_tokens // size)
                + -(-self.num_tokens_sent // size))

    def current_load(self, now: float) -> Optional[GroupLoad]:
        """The load at ``now`` without touching any state (for readers on other threads)."""
        report = self._report
        return None if report is None else self._build_load(report, now)

    def charge(self, request_id: str, num_tokens: int, now: float) -> None:
        """Count ``num_tokens`` against the replica from ``now`` on (again: re-stamped)."""
        # release() and _changed() inlined: this runs in every routing decision
        earlier = self._charges.pop(request_id, None)
        if earlier is not None:
            self.num_tokens_sent -= earlier[1]
        self._charges[request_id] = (now, num_tokens)
        self.num_tokens_sent += num_tokens
        self._load = None
        if self._on_change is not None:
            self._on_change(self.group_id)

    def note_routed(self, block_hashes: Sequence[BlockHash], now: float) -> None:
        """Count ``block_hashes`` (a prompt this group accepted) as cached here from ``now`` on."""
        routed, held = self._routed, self._held
        for block_hash in block_hashes:
            routed[block_hash] = now
            routed.move_to_end(block_hash)
        if self._index is not None:
            self._index.add(self._bit, [h for h in block_hashes if h not in held])
        held.update(block_hashes)
        self._expire_routed(now)
        self._changed()

    def _expire_routed(self, now: float) -> None:
        routed, held = self._routed, self._held
        reported = self._report.cached_block_hashes if self._report else frozenset()
        oldest = now - self.charge_ttl_s
        gone = []
        while routed and (len(routed) > MAX_ROUTED_HASHES or next(iter(routed.values())) < oldest):
            block_hash = routed.popitem(last=False)[0]
            if block_hash not in reported and block_hash in held:
                held.discard(block_hash)
                gone.append(block_hash)
        if gone and self._index is not None:
            self._index.discard(self._bit, gone)

    def _changed(self) -> None:
        self._load = None
        if self._on_change is not None:
            self._on_change(self.group_id)

    def close(self) -> None:
        """Take this group out of the index (the replica is gone)."""
        if self._index is not None:
            self._index.remove_group(self.group_id, self._held)
            self._index = None

    def release(self, request_id: str) -> None:
        """Take back a charge (the request went elsewhere); no-op if there is none."""
        charge = self._charges.pop(request_id, None)
        if charge is not None:
            self.num_tokens_sent -= charge[1]
            self._changed()

    def _take_report(self, stats: Mapping[str, Any], now: float) -> None:
        self._seen = (LoadReport.seq_of(stats),)
        try:
            report = LoadReport.from_stats(stats)
            self._build_load(report, now)  # GroupLoad checks the numbers
        except (ValueError, TypeError) as e:
            # Keep the last good report, if any: it turns stale unless a good one follows.
            logger.warning("ignoring routing stats of replica %s: %s", self.group_id, e)
            return
        self._report = report
        self._received_at = now
        held = set(report.cached_block_hashes)
        held.update(self._routed)
        if self._index is not None:
            self._index.discard(self._bit, self._held - held)
            self._index.add(self._bit, held - self._held)
        self._held = held
        # The requests the report lists are in its numbers now.
        for request_id in report.accepted_ids:
            self.release(request_id)
        # Charges no report listed in time never became requests here (cancelled while routing).
        charges = self._charges
        while charges and next(iter(charges.values()))[0] < now - self.charge_ttl_s:
            self.num_tokens_sent -= charges.popitem(last=False)[1][1]
        self._expire_routed(now)
        self._changed()

    def _build_load(self, report: LoadReport, now: float) -> GroupLoad:
        return GroupLoad(
            group_id=self.group_id,
            num_blocks_used=report.num_blocks_used,
            num_blocks_total=report.num_blocks_total,
            block_size=report.block_size,
            num_waiting_tokens=report.num_waiting_tokens,
            cached_block_hashes=self._held if report is self._report else (
                report.cached_block_hashes),
            report_seq=report.seq,
            report_age_s=max(0.0, now - self._received_at),
            num_tokens_sent_since_report=self.num_tokens_sent,
        )


class FleetLoads:
    """The loads of one list of replicas, kept by the router between decisions: patched with the
    groups a charge or release changed, and trusted while the list (Serve's, replaced with every
    replica or report update) is the same object and no report can have turned stale since it
    was built (ages only matter against ``max_report_age_s``). Replicas are anything with
    ``replica_id.unique_id`` and ``routing_stats``; a replica whose report says its engine died
    (`LoadReport.says_engine_died`) is counted in ``num_dead`` and left out.

    A fleet the router ranks with its C ranking (``keep_order``, and `is_uniform`) keeps its
    current committed blocks in ``kept`` (a `cluster.routing.fleet_order.CommittedOrder`) and
    its ``loads`` as the reports left them; any other fleet has its ``loads`` patched and
    ``kept`` None. ``native``: what the router's C ranking reads of a kept fleet, set by the
    router (None: it ranks in Python)."""

    __slots__ = ("replicas_list", "built_at", "loads", "replicas", "ranks", "by_group",
                 "position", "index_of_bit", "bits", "kept", "unreported", "num_dead",
                 "native", "_oldest_fresh_age_s")

    def __init__(self, replicas_list: Sequence[Any],
                 tracker_of: Callable[[Any], "ReplicaLoadTracker"], now: float,
                 max_report_age_s: float, keep_order: bool = False) -> None:
        self.replicas_list = replicas_list  # compared by identity
        self.built_at = now
        self.loads: List[GroupLoad] = []
        self.replicas: List[Any] = []  # loads[i] is replicas[i]'s
        self.ranks: List[List[Any]] = []  # [replicas[i]]: a rank of one, as Serve takes it
        self.by_group: Dict[str, Any] = {}
        self.position: Dict[str, int] = {}  # group id -> index in loads
        self.index_of_bit: Dict[int, int] = {}  # prefix-index bit -> index in loads
        self.unreported: List[Any] = []
        self.num_dead = 0
        self.bits = 0  # the prefix-index bits of the groups in loads
        oldest = 0.0
        for replica in replicas_list:
            stats = replica.routing_stats
            if stats and LoadReport.says_engine_died(stats):
                self.num_dead += 1  # its health check is about to fail: never send it a request
                continue
            tracker = tracker_of(replica)
            load = tracker.observe(stats, now)
            if load is None:
                self.unreported.append(replica)
                continue
            self.bits |= tracker.bit
            self.index_of_bit[tracker.bit] = self.position[load.group_id] = len(self.loads)
            self.loads.append(load)
            self.replicas.append(replica)
            self.ranks.append([replica])
            self.by_group[load.group_id] = replica
            if oldest < load.report_age_s <= max_report_age_s:
                oldest = load.report_age_s
        self._oldest_fresh_age_s = oldest
        # A patch changes charges only: a group's pool, block size and report come with a new
        # replica list (a new FleetLoads), and holds_until keeps fresh reports fresh until then.
        uniform = keep_order and is_uniform(self.loads, max_report_age_s)
        self.kept = CommittedOrder(self.loads) if uniform else None
        self.native: Optional[tuple] = None  # the router's `cluster.routing.native_rank.fleet_state`

    def holds_until(self, now: float, max_report_age_s: float) -> bool:
        """Whether every fresh report it holds is still fresh at ``now`` (stale ones stay so)."""
        return self._oldest_fresh_age_s + (now - self.built_at) <= max_report_age_s

    def patch(self, trackers: Mapping[str, "ReplicaLoadTracker"], changed: Set[str],
              now: float) -> None:
        """Take the new loads of the ``changed`` groups (each had a report, so has a load)."""
        kept = self.kept
        for group_id in changed:
            i = self.position.get(group_id)
            tracker = trackers.get(group_id)
            if i is None or tracker is None:
                continue  # not in this list (or gone: a replica update follows)
            if kept is not None:
                kept.set(i, tracker.committed_blocks())
            else:
                self.loads[i] = tracker.observe(self.replicas[i].routing_stats, now)
