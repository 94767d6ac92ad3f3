"""Continuous batching with chunked prefill, prefix-cache reuse and preemption by recompute.

Every request has ``num_tokens`` (prompt plus outputs) of which ``num_computed_tokens`` are in the
KV cache; a step gives each scheduled request ``num_tokens - num_computed_tokens`` more (one for a
decode, a chunk of the prompt for a prefill), all under one token budget:

1. Running requests, oldest first. If the pool cannot hold a request's next tokens, the newest
   running request is preempted (its blocks freed; it goes back to the head of the queue and will
   recompute, reusing whatever of its prefix stays cached) until it can.
2. Waiting requests, first come first served, while the budget, ``max_num_seqs`` and the pool
   allow; each starts after the longest prefix found in the prefix cache.

Guarantees: never a crash or a deadlock on a full pool (a request that cannot fit even alone is
finished with ``length``); a request sampled only when its last token was computed.
Cost per step: O(scheduled requests + blocks allocated).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

from kv.kv_manager import CachedPrefix, KVCacheManager, KVUsage
from kv.prefix_hash import extend_block_hashes
from workers.request import FinishReason, Request, RequestStatus
from workers.step_plan import KnownSeqStep, NewSeqStep, SeqStep, StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


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
        self._freed_seq_ids: List[int] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request (done, stopped or aborted) and free its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def schedule(self) -> ScheduledStep:
        budget = self.config.max_num_batched_tokens
        steps: List[SeqStep] = []
        scheduled: List[Tuple[Request, int]] = []
        finished: List[Request] = []
        preemptions_before = self.num_preemptions
        for request in list(self.running):
            if budget == 0 or request.status != RequestStatus.RUNNING:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._grow_or_preempt(request, num_new, finished):
                steps.append(self._seq_step(request, num_new))
                scheduled.append((request, num_new))
                budget -= num_new
        # After a preemption the pool is tight: admitting now would only thrash.
        if self.num_preemptions == preemptions_before:
            self._admit(budget, steps, scheduled, finished)
        plan = StepPlan(tuple(steps), tuple(self._freed_seq_ids))
        self._freed_seq_ids = []
        return ScheduledStep(plan, tuple(scheduled), tuple(finished))

    def _grow_or_preempt(self, request: Request, num_new: int, finished: List[Request]) -> bool:
        """Make room for ``num_new`` more tokens of a running request, preempting newer ones."""
        empty = CachedPrefix([], 0)
        target = request.num_computed_tokens + num_new
        while not self.kv.can_allocate(request.request_id, target, empty):
            victim = self.running[-1]
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
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        if request.is_known_to_ranks:
            self._freed_seq_ids.append(request.seq_id)
            request.is_known_to_ranks = False

    def _admit(self, budget: int, steps: List[SeqStep], scheduled: List[Tuple[Request, int]],
               finished: List[Request]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.kv.block_size)
            prefix = self.kv.find_cached_prefix(request.all_token_ids, request.block_hashes)
            num_new = min(request.num_tokens - prefix.num_tokens, budget)
            target = prefix.num_tokens + num_new
            if not self.kv.can_allocate(request.request_id, target, prefix):
                if not self.running:  # the whole pool is free and still too small
                    logger.warning("request %s needs %d tokens of KV, more than the whole pool; "
                                   "finishing it", request.request_id, target)
                    self.finish(request, FinishReason.LENGTH)
                    finished.append(request)
                    continue
                break
            self.waiting.popleft()
            self.kv.count_prefix_query(request.num_tokens, prefix)
            self.kv.allocate(request.request_id, target, prefix)
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            steps.append(self._seq_step(request, num_new))
            scheduled.append((request, num_new))
            budget -= num_new

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

    def update(self, step: ScheduledStep) -> None:
        """Record that the plan ran: advance computed counts and cache newly full blocks."""
        for request, num_new in step.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.kv.block_size)
            self.kv.cache_full_blocks(request.request_id, request.all_token_ids,
                                      request.block_hashes, request.num_computed_tokens)

    def kv_usage(self) -> KVUsage:
        return self.kv.usage({r.request_id: r.num_computed_tokens for r in self.running})
