"""Per-request sampling settings, validated on construction (errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k``/``top_p`` of None leave the distribution whole.
    ``seed`` makes a request's samples reproducible whatever else is in the batch.
    ``logprobs``: how many top log-probabilities to return per token besides the sampled one."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: Tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or unset), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
