"""What the engine hands out: `RequestOutput` per request choice and step, and `StepRecord` per
executed step (for throughput and roofline accounting). Importable from ``workers.engine`` too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from workers.request import RequestId
from workers.sampler import SampledToken


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
