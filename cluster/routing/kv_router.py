"""The KV-aware Serve request router: a Ray edge around `cluster.routing.ranking.rank_groups`.

    caller: handle.generate.remote(request, num_tokens=T, block_hashes=H)
      -> KVAwareRouter.choose_replicas: each replica's routing stats + tokens charged to it since
         -> GroupLoads (built on each replica update, patched per charge: `FleetLoads`)
         + every group's cached prefix of H in one walk (`PrefixIndex`)
         -> rank_groups -> [[best replica], [next], ..., [replicas without a report]]
            (for a fleet of up to 64 groups with one pool size and fresh reports, the walk and
            the ranking are one C call, `cluster.routing.native_rank`, with rank_groups' result;
            the order by committed blocks is kept in `FleetLoads.kept`, moved with each charge)
         (groups tied on every key but the group id: the one given the fewest tokens first)
         and T is charged to the first choice at once (the rest of a burst must see it)
      -> Serve tries the ranks in order (a full replica, by its queue length, is passed over)
      -> on_request_routed: a replica accepted it; count the reason, move the charge there
         (and the kept order with it: the request is on its way, the next decision is not)

The keyword arguments reach the replica's method too, so the group deployment's ``generate``
accepts ``num_tokens`` and ``block_hashes``. The request's blocks are counted at the router's
block size (`RouterSettings.block_size`, the engine's), or the groups' reported one where the
router was built without it (`_block_size`). Its ``record_routing_stats()`` returns a
`cluster.contract.LoadReport` as its stats dict (``to_stats``; the router parses it with
``from_stats``), which says what each field means. The controller polls it every
``request_routing_stats_period_s`` and pushes it to the routers when it changes, so a report is
up to about two periods old when read.

Sent-token accounting (`cluster.routing.load_report.ReplicaLoadTracker`, one per replica): a charge is
keyed by the request's internal id. When a report with a new ``seq`` arrives, the charges of the
requests it lists are in its numbers and are dropped; the rest stay counted. (Resetting the count
on each new report would forget the requests sent while the report was in transit, about half a
period of traffic.) A charge no report ever lists (a request cancelled while routing) expires
``charge_ttl_s`` after it was made. The block hashes of the prompts a replica accepted count as
cached there for as long (a report lists a prompt's blocks only once computed), merged with the
report's into one set. No clock of another host is read: a report's age is the time since this
router received it (a new ``seq``), and charge times are this router's. Acceptance is only seen
through Serve's rejection protocol (on unless the caller is a Ray Client or Java): without it
charges stay on the first choice and no reasons are counted.

A replica whose report says its engine died (``LoadReport.is_engine_alive`` False) is never
ranked: its health check fails within a period and Serve replaces it; when every replica is
such, no replica is returned and Serve asks again (with its backoff) until a replacement runs.
Replicas without a usable report (just started, or a malformed report, which is logged once)
rank last, together, so Serve picks among them by queue length: a new group gets traffic once it
reports, or when every reported group is full. When no replica has a report (right after
start-up), or for calls without ``num_tokens`` (anything but generation), the router falls back
to Serve's power of two choices. Every routed request counts one reason in `decision_counts()`: a
`RankReason` value or one of the ``FALLBACK_*`` / `NO_REPORT` labels below, and
`prefix_given_up()` counts the decisions that went to a group holding fewer of the request's
blocks than another did (a history recomputed elsewhere), with the blocks so given up.

One router lives in each caller process per deployment handle. Its decision counts are handed to
`cluster.metrics.register_router_decisions` (exported as ``tpserve:router_decisions``), and
`live_routers()` lists the live routers of this process (decision times, group loads).

Serve cloudpickles this module by value into every caller
(`RequestRouterConfig._serialize_request_router_cls`), so the class a handle runs is a copy, not
the `KVAwareRouter` importable here: nothing unpicklable may hang off the class or the globals its
methods use, and the registry is reached through the imported module, by name.
"""

from __future__ import annotations

import collections
import importlib
import logging
import threading
import time
import weakref
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from cluster.routing import native_rank
from cluster.routing.load_report import FleetLoads, ReplicaLoadTracker
from cluster.metrics import register_router_decisions
from cluster.routing.ranking import GroupLoad, RankedGroup, RequestDemand, rank_groups, tied_with_first
from cluster.routing.decision import (  # the labels are tpserve:router_decisions' too
    FALLBACK_BAD_DEMAND,
    FALLBACK_NO_NUM_TOKENS,
    FALLBACK_NO_REPORTS,
    NO_HEALTHY_GROUP,
    NO_REPORT,
    PendingDecision,
)
from cluster.routing.fleet_order import UniformRanking
from cluster.routing.prefix_index import PrefixIndex
from cluster.routing.settings import RouterSettings

logger = logging.getLogger(__name__)


# Decisions waiting for on_request_routed. Serve may report a fast request completed before it
# reports it routed, so completion cannot clear them; the ones never routed (cancelled while
# waiting for a replica) leave the oldest-first once this many wait.
MAX_PENDING_REQUESTS = 4096

# The routers of this process; see the module doc for why methods reach these by module name.
_live_routers: "weakref.WeakSet[KVAwareRouter]" = weakref.WeakSet()
_live_routers_lock = threading.Lock()


def live_routers() -> List["KVAwareRouter"]:
    """The live KV-aware routers of this process (one per deployment handle that routed)."""
    with _live_routers_lock:
        return list(_live_routers)


def _register(router: "KVAwareRouter") -> None:
    module = importlib.import_module(__name__)  # the imported module, even from a pickled copy
    with module._live_routers_lock:
        module._live_routers.add(router)


class KVAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Places each generation request on the TP group with room for it (see the module doc).

    Not FIFOMixin on purpose: with it Serve hands a replica chosen for one request to the oldest
    waiting one, which would undo a per-request decision.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._settings = RouterSettings()
        # By ReplicaID.unique_id: a str hashes in C, a ReplicaID in Python (this is per replica
        # per decision).
        self._trackers: Dict[str, ReplicaLoadTracker] = {}
        # The loads of Serve's replica list, patched with the groups changed since (see _fleet).
        self._fleet_cache: Optional[FleetLoads] = None
        self._changed: Set[str] = set()
        self._pending: "collections.OrderedDict[str, PendingDecision]" = (
            collections.OrderedDict()
        )
        # Read from other threads (metrics), written on the router's event loop.
        self._stats_lock = threading.Lock()
        self._decision_counts: collections.Counter = collections.Counter()
        # By "<reason>_from_<reason>" (prefix_given_up): decisions that went to a group holding
        # fewer of the request's blocks than another did, and the blocks given up so.
        self._prefix_left: collections.Counter = collections.Counter()
        self._prefix_blocks_left: collections.Counter = collections.Counter()
        self._decision_times_us: Deque[float] = collections.deque(maxlen=4096)
        self._warned_bad_demand = False
        # The C ranking of uniform fleets (built here, off the decision path); None: Python.
        self._native = native_rank.load()
        # Every tracker's cached hashes, by group bit: one walk finds all groups' prefixes.
        self._prefix_index = PrefixIndex(self._native)
        _register(self)
        register_router_decisions(self._decision_counts)  # /metrics of the caller's process

    def initialize_state(self, **kwargs: Any) -> None:
        """Takes ``request_router_kwargs``: see `cluster.app.kv_aware_router_config`."""
        self._settings = RouterSettings(**kwargs)
        self._decision_times_us = collections.deque(maxlen=self._settings.num_decision_times)

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    def decision_counts(self) -> Dict[str, int]:
        """Routed requests by reason (a `RankReason` value or a ``FALLBACK_*`` label)."""
        with self._stats_lock:
            return dict(self._decision_counts)

    def prefix_given_up(self) -> Dict[str, Dict[str, int]]:
        """``decisions`` that placed a request on a group holding fewer of its leading blocks than
        another group did, and the ``blocks`` so given up (summed), by ``<reason>_from_<reason>``:
        the chosen group's reason, then that of the group holding the most."""
        with self._stats_lock:
            return {"decisions": dict(self._prefix_left),
                    "blocks": dict(self._prefix_blocks_left)}

    def group_loads(self) -> Dict[str, GroupLoad]:
        """Each reporting replica's load now (its report plus its charges), by group id."""
        now = time.time()
        loads = (tracker.current_load(now) for tracker in list(self._trackers.values()))
        return {load.group_id: load for load in loads if load is not None}

    def decision_times_us(self) -> List[float]:
        """The latest routing decision times in microseconds (KV-aware decisions only)."""
        with self._stats_lock:
            return list(self._decision_times_us)

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is None:
            return await self._power_of_two(candidate_replicas, pending_request)
        start_ns = time.perf_counter_ns()
        request_id = pending_request.metadata.internal_request_id
        # Few function calls on this path: each costs a fetch of its code when caches are cold
        # (docs/benchmarks/router-decision.md), so small helpers are inlined here.
        earlier = self._pending.pop(request_id, None)
        if earlier is not None:  # a retry: its earlier choice refused it
            self._release(earlier, request_id)
        num_tokens = pending_request.kwargs.get("num_tokens")
        if num_tokens is None:
            self._remember(request_id, PendingDecision(0, None, FALLBACK_NO_NUM_TOKENS))
            return await self._power_of_two(candidate_replicas, pending_request)
        ranks, decision = self._rank(candidate_replicas, pending_request.kwargs, num_tokens)
        if ranks == []:  # every group's engine died: Serve asks again until a replacement runs
            # Without this flag Serve's routing loop asks again at once and never yields its
            # event loop: the replica update that brings the replacement would never arrive.
            pending_request.routing_context.should_backoff = True
            return []
        if ranks is None:
            self._remember(request_id, decision)
            return await self._power_of_two(candidate_replicas, pending_request)
        if len(ranks) > 1:
            self._break_ties(ranks, decision.ranked)
        # Charge the first choice now, not when it accepts: the routing tasks of a burst run
        # before any acceptance comes back, and must see each other's requests.
        charged = decision.charged = ranks[0][0].replica_id
        tokens = decision.first_tokens
        if tokens is None:
            tokens = decision.tokens_on(charged.unique_id)
        tracker = self._trackers.get(charged.unique_id) or self._tracker(charged)
        tracker.charge(request_id, tokens, time.time())
        pending = self._pending
        pending[request_id] = decision
        if len(pending) > MAX_PENDING_REQUESTS:
            self._remember(request_id, decision)  # drops the oldest
        elapsed_us = (time.perf_counter_ns() - start_ns) / 1000
        with self._stats_lock:
            self._decision_times_us.append(elapsed_us)
        return ranks

    def _break_ties(self, ranks: List[List[RunningReplica]],
                    ranked: Optional[Sequence[RankedGroup]]) -> None:
        """Orders the groups ranked first that tie on every key but the group id by the tokens
        each accepted so far, fewest first (`cluster.routing.ranking` says why), in place. Tied groups
        hold the same prefix, so what the request adds to each (``first_tokens``) is the same."""
        if isinstance(ranked, UniformRanking):
            lead = ranked.tied_with_first()
        else:
            lead = tied_with_first(ranked or ())
        if lead > 1:
            trackers = self._trackers
            ranks[:lead] = sorted(ranks[:lead], key=lambda rank: trackers[
                rank[0].replica_id.unique_id].num_tokens_accepted)

    def _rank(
        self,
        candidate_replicas: List[RunningReplica],
        request_kwargs: Mapping[str, Any],
        num_tokens: Any,
    ) -> Tuple[Optional[List[List[RunningReplica]]], PendingDecision]:
        """Ranked replicas and the decision to remember; (None, fallback) to fall back."""
        fleet = self._fleet(candidate_replicas, time.time())
        if fleet.native is not None:  # a uniform fleet of up to 64 groups: one C call
            block_size = self._block_size(fleet.loads)
            try:
                (ranks, order, committed, prefix, base, num_blocks, hashes,
                 first_tokens) = self._native.rank(
                    fleet.native, request_kwargs.get("block_hashes") or (), num_tokens,
                    block_size)
            except (TypeError, ValueError, OverflowError):
                pass  # a demand it refuses: the Python path below says why
            else:
                ranked = UniformRanking(order, fleet.loads, committed, prefix, base,
                                            num_blocks, self._settings.target_occupancy)
                if fleet.unreported:
                    ranks.append(list(fleet.unreported))
                return ranks, PendingDecision(num_tokens, ranked, NO_REPORT, None, hashes,
                                               block_size, first_tokens)
        loads, by_group, unreported = fleet.loads, fleet.by_group, fleet.unreported
        if not loads and not unreported and fleet.num_dead:
            return [], PendingDecision(0, None, NO_HEALTHY_GROUP)
        if not loads:
            # Still charged where it lands: the first reports then start from the right count.
            valid = isinstance(num_tokens, int) and num_tokens >= 0
            return None, PendingDecision(num_tokens if valid else 0, None, FALLBACK_NO_REPORTS)
        try:
            demand = RequestDemand(num_tokens, tuple(request_kwargs.get("block_hashes") or ()),
                                   self._block_size(loads))
        except (ValueError, TypeError) as e:
            if not self._warned_bad_demand:
                self._warned_bad_demand = True
                logger.warning("routing by power of two choices: bad request demand: %s", e)
            return None, PendingDecision(0, None, FALLBACK_BAD_DEMAND)
        settings = self._settings
        ranked = rank_groups(
            demand, loads, settings.target_occupancy, settings.max_report_age_s,
            settings.prefix_weight, settings.load_weight,
            self._prefix_index.prefix_blocks(demand.block_hashes))
        ranks = [[by_group[group.group_id]] for group in ranked]
        if unreported:
            ranks.append(list(unreported))  # a copy: the kept loads must not change with it
        return ranks, PendingDecision(demand.num_tokens, ranked,
                                       block_hashes=demand.block_hashes,
                                       block_size=demand.block_size or 1)

    def _fleet(self, candidate_replicas: List[RunningReplica], now: float) -> FleetLoads:
        """The candidates' loads. Serve passes its own replica list, a new object with every
        replica or report update; `update_replicas` builds its loads, and a decision only looks
        again at the groups changed since (charges, releases), not at every group (a loop over
        every group is most of a decision when caches are cold: docs/benchmarks/router-decision.md)."""
        fleet = self._fleet_cache
        changed = self._changed
        max_age_s = self._settings.max_report_age_s
        if (fleet is not None and fleet.replicas_list is candidate_replicas
                and fleet.holds_until(now, max_age_s)):
            if changed:  # charges of decisions not yet accepted (acceptances patch it at once)
                fleet.patch(self._trackers, changed, now)
                changed.clear()
            return fleet
        changed.clear()
        fleet = self._new_fleet(candidate_replicas, now)
        # Only Serve's list is replaced on every update; a list of the caller's may change in place.
        self._fleet_cache = fleet if candidate_replicas is self._replicas_list else None
        return fleet

    def _new_fleet(self, replicas: List[RunningReplica], now: float) -> FleetLoads:
        fleet = FleetLoads(replicas, self._tracker_of, now, self._settings.max_report_age_s,
                           keep_order=self._native is not None)
        if self._native is not None:
            fleet.native = native_rank.fleet_state(self._prefix_index, fleet, self._settings)
        return fleet

    def _block_size(self, loads: Sequence[GroupLoad]) -> int:
        """The block size the request's blocks are counted at: the router's (the engine's), else
        the first group's report."""
        return self._settings.block_size or loads[0].block_size

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """The replica accepted the request: count its reason, move its charge there."""
        request_id = pending_request.metadata.internal_request_id
        decision = self._pending.pop(request_id, None)
        if decision is None:
            return
        if decision.ranked is None:
            reason = decision.fallback_reason
        else:
            group_id = replica_id.unique_id
            reason = next(
                (p.reason.value for p in decision.ranked if p.group_id == group_id),
                NO_REPORT,
            )
        self._release(decision, request_id)
        tracker = self._tracker(replica_id)
        now = time.time()
        if decision.num_tokens:
            # Re-stamped at acceptance: a report taken from now on holds the request.
            tokens = decision.tokens_on(replica_id.unique_id)
            tracker.charge(request_id, tokens, now)
            tracker.num_tokens_accepted += tokens
        if decision.block_hashes:
            tracker.note_routed(decision.block_hashes, now)
        longest, home = decision.longest_cached()
        given_up = longest - decision.cached_on(replica_id.unique_id)
        key = f"{reason}_from_{home}"  # where it went, and where the longest prefix was
        with self._stats_lock:
            self._decision_counts[reason] += 1
            if given_up > 0:
                self._prefix_left[key] += 1
                self._prefix_blocks_left[key] += given_up
        # Move the kept loads now, after the request went out, rather than in the next decision.
        fleet = self._fleet_cache
        if fleet is not None and self._changed and fleet.holds_until(
                now, self._settings.max_report_age_s):
            fleet.patch(self._trackers, self._changed, now)
            self._changed.clear()

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now = time.time()
        live = {replica_id.unique_id for replica_id in self._replicas}
        for group_id in list(self._trackers):
            if group_id not in live:
                self._trackers.pop(group_id).close()
        # New reports arrive with replica updates: parse them here, off the decision path, into
        # the loads the decisions use until the next update.
        self._fleet_cache = self._new_fleet(self._replicas_list, now)
        self._changed.clear()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        tracker = self._trackers.pop(replica_id.unique_id, None)
        if tracker is not None:
            tracker.close()
        self._fleet_cache = None

    def _tracker_of(self, replica: RunningReplica) -> ReplicaLoadTracker:
        return self._trackers.get(replica.replica_id.unique_id) or self._tracker(replica.replica_id)

    def _tracker(self, replica_id: ReplicaID) -> ReplicaLoadTracker:
        group_id = replica_id.unique_id
        tracker = self._trackers.get(group_id)
        if tracker is None:
            tracker = self._trackers[group_id] = ReplicaLoadTracker(
                group_id, self._settings.charge_ttl_s, self._prefix_index, self._changed.add)
        return tracker

    def _drop_pending(self, request_id: str) -> None:
        earlier = self._pending.pop(request_id, None)
        if earlier is not None:
            self._release(earlier, request_id)

    def _release(self, decision: PendingDecision, request_id: str) -> None:
        if decision.charged is not None:
            tracker = self._trackers.get(decision.charged.unique_id)
            if tracker is not None:  # else the replica is gone, and its charges with it
                tracker.release(request_id)

    def _remember(self, request_id: str, decision: PendingDecision) -> None:
        self._pending[request_id] = decision
        while len(self._pending) > MAX_PENDING_REQUESTS:
            self._pending.popitem(last=False)  # its charge goes with the replica's next report

    async def _power_of_two(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest],
    ) -> List[List[RunningReplica]]:
        # Serve's own default, as its CapacityQueueRouter and PrefixCacheAffinityRouter reuse it.
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidate_replicas, pending_request=pending_request
        )
