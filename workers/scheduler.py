"""Continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute.

Every request has ``num_tokens`` (prompt plus outputs) of which ``num_computed_tokens`` are in the
KV cache; a step gives each scheduled request ``num_tokens - num_computed_tokens`` more (one for a
decode, a chunk of the prompt for a prefill), all under one token budget:

1. Running requests, oldest first. If the pool cannot hold a request's next tokens, the newest
   running request is preempted (its blocks freed; it goes back to the head of the queue) until it
   can. With a host tier its full blocks are written through to host memory and its partly filled
   last block swapped to a private host slot, so it resumes by copying them back; without one it
   recomputes whatever of its prefix no longer is cached.
2. Waiting requests, first come first served, while the budget, ``max_num_seqs`` and the pool
   allow; each starts after the longest prefix found in the prefix cache. A prefix that
   continues on host or disk is restored first: the request waits in ``loading`` (the others
   keep running) until every rank has its blocks, then runs from the first block that did not
   come back intact. With the engine's ``run_transfers`` hook, the step that starts restores
   runs them first and waits, so the restored requests compute in that same step. The choices of an ``n`` > 1 request after the first wait (without blocking
   the queue) until the first has computed the shared prompt, then find its full blocks cached:
   one prefill for all of them.

When every layer of the model has the same sliding window, a running request's leading blocks
are freed once they left the window of its next token (no layer reads them again; the attention
gathers only the window), so a long decode holds about ``window / block_size + 2`` blocks.

With the overlapped step loop a request may carry tokens sampled on the device whose ids the host
does not know yet (``Request.num_pending``): they count as tokens to compute (the ranks take their
ids from the device), are never hashed or cached until known, and a request whose last pending
token ends it is not scheduled again.

Guarantees: never a crash or a deadlock on a full pool (a request that cannot fit even alone is
finished with ``length``); a request sampled only when its last token was computed.
Cost per step: O(scheduled requests + blocks allocated).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

from kv.attention.metadata import first_key_position
from kv.kv_manager import CachedPrefix, KVCacheManager, KVUsage
from kv.prefix_hash import extend_block_hashes, hash_block
from kv.tiers.ops import Restore, TierOp, TierOpResults
from kv.tiers.records import LowerHit, RestoreChain
from workers.request import FinishReason, Request, RequestStatus, SwappedTail
from workers.step_plan import KnownSeqStep, NewSeqStep, SeqStep, StepPlan

logger = logging.getLogger(__name__)
_NO_PREFIX = CachedPrefix([], 0)  # growing a table that already exists: no cached prefix to take


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # The window every layer of the model has (blocks that left it are freed); None when any
    # layer attends to the whole context.
    sliding_window: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")


@dataclass(frozen=True)
class _Loading:
    chain: RestoreChain
    num_device_blocks: int  # leading blocks found on the device
    num_lower_blocks: int  # full blocks being restored from host or disk
    tail: Optional[SwappedTail]  # and the swapped-out partial block, if it comes back too


@dataclass(frozen=True)
class ScheduledStep:
    plan: StepPlan
    scheduled: Tuple[Tuple[Request, int], ...]  # (request, tokens computed this step)
    finished: Tuple[Request, ...]  # finished while scheduling (could never fit)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.loading: Dict[Request, _Loading] = {}
        self._freed_seq_ids: List[int] = []
        self.num_preemptions = 0
        # Runs tier ops on every rank and waits for them (the engine's hook). When set, a step
        # that starts restores runs its transfers first, so the restored requests compute in
        # this step rather than the next (see ``_restore_now``).
        self.run_transfers: Optional[
            Callable[[Tuple[TierOp, ...]], Optional[TierOpResults]]] = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request (done, stopped or aborted) and free its blocks.

        A loading request keeps its blocks until its restores commit (ranks may still write them)."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
            self._release(request)
            if request.swapped_tail is not None:
                self._drop_tail(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        steps: List[SeqStep] = []
        scheduled: List[Tuple[Request, int]] = []
        finished: List[Request] = []
        preemptions_before = self.num_preemptions
        for request in list(self.running):
            if budget == 0 or request.status != RequestStatus.RUNNING or request.final_pending:
                continue  # a final pending token: the request ends once its id is known
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._grow_or_preempt(request, num_new, finished):
                steps.append(self._seq_step(request, num_new))
                scheduled.append((request, num_new))
                budget -= num_new
        # After a preemption the pool is tight: admitting now would only thrash.
        if self.num_preemptions == preemptions_before:
            self._admit(budget, steps, scheduled, finished)
        tier_ops = self.kv.tiers.take_ops() if self.kv.tiers is not None else ()
        if self.run_transfers is not None and any(isinstance(op, Restore) for op in tier_ops):
            tier_ops = self._restore_now(tier_ops, steps, scheduled)
        # Nothing to compute: the ranks wait for the transfers instead of polling them.
        plan = StepPlan(tuple(steps), tuple(self._freed_seq_ids), tier_ops=tier_ops,
                        wait_spill_reads=self._writes_spilling_block(scheduled),
                        wait_transfers=not steps)
        self._freed_seq_ids = []
        return ScheduledStep(plan, tuple(scheduled), tuple(finished))

    def _restore_now(self, tier_ops: Tuple[TierOp, ...], steps: List[SeqStep],
                     scheduled: List[Tuple[Request, int]]) -> Tuple[TierOp, ...]:
        """Run this step's transfers up to its last restore on every rank and wait for them
        before its compute, then schedule the requests they restored into this step, within what
        is left of the token budget and without preempting anyone (those that do not fit run
        next step). Returns the ops after the last restore, for the step's plan.

        A restore from host is a copy of a few MB (from disk, a read); waiting for it costs far
        less than the step a restored request would otherwise wait, and its first token comes
        one step sooner. The ops after it (spills of blocks released the step before, their
        disk writes) run during the step's compute, as every step's do. Ops queued before it
        are waited for too: the worker runs them in order."""
        assert self.run_transfers is not None
        last = max(i for i, op in enumerate(tier_ops) if isinstance(op, Restore))
        results = self.run_transfers(tier_ops[:last + 1])
        num_running = len(self.running)
        if results is not None:
            assert self.kv.tiers is not None
            self.kv.tiers.commit(results)
            self._finish_loading()
        budget = self.config.max_num_batched_tokens - sum(n for _, n in scheduled)
        for request in self.running[num_running:]:  # moved from loading just now
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_new
            if num_new <= 0 or not self.kv.can_allocate(request.request_id, target, _NO_PREFIX):
                continue
            self.kv.allocate(request.request_id, target, _NO_PREFIX)
            steps.append(self._seq_step(request, num_new))
            scheduled.append((request, num_new))
            budget -= num_new
        return tier_ops[last + 1:]

    def _writes_spilling_block(self, scheduled: List[Tuple[Request, int]]) -> bool:
        """Whether this step writes KV into a block that a queued spill may still be reading."""
        tiers, bs = self.kv.tiers, self.kv.block_size
        if tiers is None or not tiers.has_spills_in_flight:
            return False
        for request, num_new in scheduled:
            first = request.num_computed_tokens // bs
            last = (request.num_computed_tokens + num_new - 1) // bs
            written = self.kv.block_ids(request.request_id, first, last + 1)
            if any(tiers.is_being_read(b) for b in written):
                return True
        return False

    def _grow_or_preempt(self, request: Request, num_new: int, finished: List[Request]) -> bool:
        """Make room for ``num_new`` more tokens of a running request, preempting newer ones."""
        empty = CachedPrefix([], 0)
        target = request.num_computed_tokens + num_new
        while not self.kv.can_allocate(request.request_id, target, empty):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1 and self.loading:
                return False  # loading requests hold blocks; once they run they can be preempted
            if victim is request and len(self.running) == 1 and request.num_pending:
                return False  # its sampled tokens count: it ends once the host knows them
            if victim is request and len(self.running) == 1:
                logger.warning("request %s needs %d tokens of KV, more than the pool holds; "
                               "finishing it", request.request_id, target)
                self.finish(request, FinishReason.LENGTH)
                finished.append(request)
                return False
            self._preempt(victim)
            if victim is request:
                return False
        self.kv.allocate(request.request_id, target, empty)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._swap_out_tail(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _swap_out_tail(self, request: Request) -> None:
        """Keep a preempted request's partly filled last block in a private host slot."""
        tiers, bs = self.kv.tiers, self.kv.block_size
        num_partial = request.num_computed_tokens % bs
        if tiers is None or not num_partial or not tiers.can_swap_out():
            return
        index = request.num_computed_tokens // bs
        parent = request.block_hashes[index - 1] if index else None
        tag = hash_block(parent, request.all_token_ids[index * bs:request.num_computed_tokens])
        slot = tiers.swap_out(self.kv.blocks(request.request_id)[index], tag)
        request.swapped_tail = SwappedTail(slot, index, num_partial, tag)

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        if request.is_known_to_ranks:
            self._freed_seq_ids.append(request.seq_id)
            request.is_known_to_ranks = False

    def _drop_tail(self, request: Request) -> None:
        assert request.swapped_tail is not None and self.kv.tiers is not None
        self.kv.tiers.release_private(request.swapped_tail.host_slot)
        request.swapped_tail = None

    def _admit(self, budget: int, steps: List[SeqStep], scheduled: List[Tuple[Request, int]],
               finished: List[Request]) -> None:
        held_back: List[Request] = []  # choices waiting for their leader's prefill
        while (self.waiting and budget > 0
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted with a token in flight: admitted once its id is known
            if request.waits_for_leader:
                held_back.append(self.waiting.popleft())
                continue
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.kv.block_size)
            prefix = self.kv.find_cached_prefix(request.all_token_ids, request.block_hashes)
            hits, tail = self._find_lower(request, prefix)
            if hits or tail is not None:
                num_new = 0  # restored first, computed once loaded
                target = (prefix.num_tokens + len(hits) * self.kv.block_size
                          + (tail.num_tokens if tail is not None else 0))
            else:
                num_new = min(request.num_tokens - prefix.num_tokens, budget)
                target = prefix.num_tokens + num_new
            if not self.kv.can_allocate(request.request_id, target, prefix):
                if not self.running and not self.loading:  # the whole pool is free, too small
                    logger.warning("request %s needs %d tokens of KV, more than the whole pool; "
                                   "finishing it", request.request_id, target)
                    self.finish(request, FinishReason.LENGTH)
                    finished.append(request)
                    continue
                break
            self.waiting.popleft()
            num_hit = target if num_new == 0 else prefix.num_tokens
            self.kv.count_prefix_query(request.num_tokens, prefix, num_hit, request.block_hashes)
            if hits:
                self.kv.tiers.hold(hits)  # until _start_loading's restore has queued them
            self.kv.allocate(request.request_id, target, prefix)
            if num_new == 0:
                self._start_loading(request, prefix, hits, tail)
                continue
            if request.swapped_tail is not None:
                self._drop_tail(request)  # its prefix did not survive: it recomputes
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            steps.append(self._seq_step(request, num_new))
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(held_back))

    def _seq_step(self, request: Request, num_new: int) -> SeqStep:
        start = request.num_computed_tokens
        tokens = tuple(request.all_token_ids[start:start + num_new])
        needs_logits = start + num_new == request.num_tokens
        block_ids = self.kv.block_ids(request.request_id)
        if not request.is_known_to_ranks:
            request.is_known_to_ranks = True
            request.num_blocks_sent = len(block_ids)
            return NewSeqStep(request.seq_id, tokens, start, tuple(block_ids), needs_logits)
        new_ids = tuple(block_ids[request.num_blocks_sent:])
        request.num_blocks_sent = len(block_ids)
        return KnownSeqStep(request.seq_id, tokens, new_ids, needs_logits)

    def _find_lower(self, request: Request, prefix: CachedPrefix
                    ) -> Tuple[List[LowerHit], Optional[SwappedTail]]:
        """The prefix's continuation on host or disk, and the swapped tail if it reaches it."""
        tiers = self.kv.tiers
        if tiers is None or not self.kv.enable_prefix_cache:
            return [], None
        start = len(prefix.blocks)
        end = (request.num_tokens - 1) // self.kv.block_size  # leave a token to compute
        hits = tiers.find_lower(request.all_token_ids, request.block_hashes, start, end)
        if not tiers.host.can_take():  # every host slot private: disk hits cannot be read back
            hits = hits[:next((i for i, h in enumerate(hits) if h.tier == "disk"), len(hits))]
        tail = request.swapped_tail
        if tail is None or start + len(hits) != tail.block_index:
            tail = None
        return hits, tail

    def _start_loading(self, request: Request, prefix: CachedPrefix, hits: List[LowerHit],
                       tail: Optional[SwappedTail]) -> None:
        assert self.kv.tiers is not None
        self.kv.tiers.count_lookup(
            (request.num_tokens - 1) // self.kv.block_size - len(prefix.blocks), hits)
        blocks = self.kv.blocks(request.request_id)
        start = len(prefix.blocks)
        swapped = None
        if tail is not None:
            swapped = (tail.host_slot, tail.tag, blocks[start + len(hits)])
        chain = self.kv.tiers.restore(hits, blocks[start:start + len(hits)], swapped)
        if request.swapped_tail is not None:
            self._drop_tail(request)  # its copy back is queued: the slot may be reused behind it
        request.status = RequestStatus.LOADING
        self.loading[request] = _Loading(chain, start, len(hits), tail)

    def _finish_loading(self) -> None:
        """Requests whose restores every rank has finished start running (or are released)."""
        assert self.kv.tiers is not None
        bs = self.kv.block_size
        for request, state in list(self.loading.items()):
            if not state.chain.is_done(self.kv.tiers.num_committed):
                continue
            del self.loading[request]
            if request.is_finished:  # aborted while loading
                self.kv.free(request.request_id)
                continue
            num_ok = state.chain.num_ok
            computed = (state.num_device_blocks + min(num_ok, state.num_lower_blocks)) * bs
            if state.tail is not None and num_ok == len(state.chain.hashes):
                computed += state.tail.num_tokens
            request.num_computed_tokens = computed
            self.kv.cache_full_blocks(request.request_id, request.all_token_ids,
                                      request.block_hashes, computed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def update(self, step: ScheduledStep, tier_results: Optional[TierOpResults] = None) -> None:
        """Record that the plan ran: advance computed counts and cache newly full blocks; apply
        the tier transfers the ranks agreed have finished."""
        if tier_results is not None:
            assert self.kv.tiers is not None
            self.kv.tiers.commit(tier_results)
            self._finish_loading()
        for request, num_new in step.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.kv.block_size,
                                request.num_known_tokens)
            self.kv.cache_full_blocks(request.request_id, request.all_token_ids,
                                      request.block_hashes, request.num_computed_tokens)
            if self.config.sliding_window is not None:
                self._free_out_of_window(request)

    def _free_out_of_window(self, request: Request) -> None:
        """Free the leading blocks whose every token is older than the window of the request's
        next token: the attention never gathers them again (``first_key_position``)."""
        first = first_key_position(request.num_computed_tokens, self.config.sliding_window)
        self.kv.free_leading_blocks(request.request_id, first // self.kv.block_size)

    def kv_usage(self) -> KVUsage:
        return self.kv.usage({r.request_id: r.num_computed_tokens for r in self.running})
