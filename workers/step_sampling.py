"""Rank 0's sampling of a step, and the overlapped step loop's bookkeeping of sampled ids.

Each step samples on the device; its ids go to the host by an asynchronous copy
(`workers.sample_copy`) and, until the host reads them, each sampled request carries a pending
token (`Request.add_pending`) that the next step computes from the device. The engine reads a
step's ids either at once (the serial loop) or after launching the next step (the overlapped
loop), whose device work then hides the host's: the copy's wait, appending, stop checks,
detokenizing, outputs and scheduling.

Reading a step's ids first, before scheduling the next, is needed when a request of it samples
from its own history (penalties, ``min_tokens``) or under a grammar: its next logits are processed
with every earlier token known. A request that stopped at step N has computed one more token in
step N+1, which is dropped: a wasted slot, never a wrong token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from workers.rank import Rank, share_sampled
from workers.request import Request
from workers.sample_copy import SampleCopier, SampleCopy
from workers.sampler import SampledToken, sample_on_device
from workers.scheduler import ScheduledStep
from workers.step_logits import StepLogits
from workers.step_plan import StepPlan
from workers.structured.decoding import StructuredDecoding


@dataclass(frozen=True)
class LaunchedStep:
    """A step's sampled requests (row i sampled for ``requests[i]``) and their ids' copy."""

    requests: Tuple[Request, ...]
    copy: SampleCopy

    def needs_ids_first(self) -> bool:
        """Whether a request of it needs its ids known before it is scheduled again."""
        return any(not r.is_finished and (r.params.processes_logits or r.grammar is not None)
                   for r in self.requests)

    def read(self) -> List[Tuple[Request, SampledToken]]:
        """Each unfinished request with its token (waits for the copy); aborted ones drop it."""
        tokens = self.copy.wait()
        return [(r, t) for r, t in zip(self.requests, tokens) if not r.is_finished]


class StepSampler:
    """Samples the rows of each step on rank 0 and launches the copy of their ids."""

    def __init__(self, rank: Rank, structured: StructuredDecoding, eos_token_ids: Sequence[int],
                 max_model_len: int, overlap: bool, max_rows: int) -> None:
        self.rank = rank
        self.structured = structured
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.overlap = overlap
        self._copier = SampleCopier(rank.runner.device, max_rows)

    def plan_to_send(self, plan: StepPlan) -> StepPlan:
        """``plan`` as the ranks get it: with the sampled ids shared when a later plan may name
        them (the overlapped loop with ranks 1..N-1)."""
        if (self.overlap and self.rank.tp.world_size > 1
                and any(seq.needs_logits for seq in plan.seqs)):
            return dataclasses.replace(plan, share_sampled=True)
        return plan

    def launch(self, scheduled: ScheduledStep, plan: StepPlan,
               step: Optional[StepLogits]) -> Optional[LaunchedStep]:
        """Sample the rows of ``plan`` that need it from ``step`` (the graph's greedy ids when it
        has them and every row is plainly greedy); the ids stay on the device (every rank's
        ``last_sampled``) and their copy to the host starts, all queued before the next step's
        model run (`workers.step_logits`). None: nothing sampled."""
        requests = [r for (r, _), seq in zip(scheduled.scheduled, plan.seqs) if seq.needs_logits]
        if not requests:
            return None
        assert step is not None and step.logits.shape[0] == len(requests)
        samples = sample_on_device(
            step.logits, [r.params for r in requests], [r.generator for r in requests],
            [(r.prompt_token_ids, r.output_token_ids) for r in requests], self.eos_token_ids,
            self.structured.masks([r.grammar for r in requests]), step.greedy_ids)
        self.rank.runner.last_sampled = samples.tokens
        if plan.share_sampled:
            share_sampled(self.rank, plan, samples.tokens)
        for row, request in enumerate(requests):
            request.add_pending(row, self.max_model_len)
        return LaunchedStep(tuple(requests), self._copier.start(samples))
