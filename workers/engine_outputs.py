"""What the engine hands out: `RequestOutput` per request choice and step, and `StepRecord` per
executed step (for throughput and roofline accounting). Importable from ``workers.engine`` too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from workers.request import Request, RequestId
from workers.sampler import SampledToken
from workers.scheduler import ScheduledStep


@dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one choice of a request; ``text`` and ``output_token_ids`` are
    cumulative. ``finished`` is this choice's; a request ends when all ``n`` have."""

    request_id: RequestId
    prompt_token_ids: List[int]
    output_token_ids: List[int]
    new_token_ids: List[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: Optional[str]
    logprobs: List[SampledToken]
    index: int = 0  # which of the request's ``n`` choices


def request_output(request: Request, new_ids: List[int], delta: str, text: str
                   ) -> RequestOutput:
    """``request``'s output now: ``new_ids`` and ``delta`` this step, ``text`` so far."""
    return RequestOutput(
        request_id=request.parent_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(request.output_token_ids),
        new_token_ids=new_ids,
        text=text,
        delta_text=delta,
        finished=request.is_finished,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        logprobs=list(request.output_logprobs),
        index=request.index,
    )


@dataclass(frozen=True)
class StepRecord:
    """Shape of one executed step, for throughput and roofline accounting."""

    seqs: Tuple[Tuple[int, int], ...]  # per scheduled sequence: (tokens cached before, new)
    num_logits: int
    duration_s: float

    @property
    def num_tokens(self) -> int:
        return sum(new for _, new in self.seqs)

    @property
    def num_context_tokens(self) -> int:
        """Tokens already in the cache that the step's sequences attend to."""
        return sum(cached for cached, _ in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        return all(new == 1 for _, new in self.seqs)


def step_record(scheduled: ScheduledStep, duration_s: float) -> StepRecord:
    """The shape of ``scheduled``, once the scheduler has advanced each request by its new
    tokens."""
    seqs = tuple((r.num_computed_tokens - n, n) for r, n in scheduled.scheduled)
    return StepRecord(seqs, sum(s.needs_logits for s in scheduled.plan.seqs), duration_s)
