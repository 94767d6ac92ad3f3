"""Per-request sampling settings, validated on construction (errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from workers.structured.spec import StructuredOutput


MAX_N = 64  # choices per request: each one is a sequence in the batch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k``/``top_p`` of None leave the distribution whole.
    ``seed`` makes a request's samples reproducible whatever else is in the batch.
    ``logprobs``: how many top log-probabilities to return per token besides the sampled one.

    Logit processing, in the order ``transformers`` applies it: ``logit_bias`` (token id ->
    added logit), ``repetition_penalty`` (over prompt and output, as ``transformers`` does),
    ``presence_penalty`` / ``frequency_penalty`` (over the output, as OpenAI does),
    ``min_tokens`` (EOS and stop tokens are masked until that many tokens were generated),
    then temperature, ``top_k``, ``top_p``, ``min_p``. ``n`` choices share one prefill; with a
    ``seed``, choice i draws from ``seed + i``. ``structured``: every output token keeps the
    output a prefix of what the constraint accepts, and the request stops when it is complete
    (`workers.structured`)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: Tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    logprobs: Optional[int] = None
    n: int = 1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    structured: Optional[StructuredOutput] = None

    def __post_init__(self) -> None:
        self._check_ranges()
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(k): float(v)
                                                for k, v in self.logit_bias.items()})

    def _check_ranges(self) -> None:
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
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than 0, got "
                             f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        bad = {k: v for k, v in self.logit_bias.items() if not -100.0 <= float(v) <= 100.0}
        if bad:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before greedy or random choice."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.min_tokens)
