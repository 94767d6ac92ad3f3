"""How many output tokens the router charges a request before the group reports its real use.

A request without ``max_tokens`` may run to the end of the context, but charging every such
request the whole remaining context pushes each group over the occupancy target after a few of
them, and soon past a full pool, where the router no longer counts cached prefixes
(`cluster.routing.ranking`). So the charge is a high quantile of the output lengths of recently
finished requests (one model per ingress), bounded by the request's ``max_tokens``; a prior
holds until enough requests have finished. The charge is only a bridge: once the group's next
report lists the request, its real KV use replaces it.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Deque, Optional


class OutputLengthEstimate:
    """The ``quantile`` of the last ``window`` finished choices' output lengths.

    Costs: O(1) per record; O(window log window) per estimate, done at most once every
    ``window // 16`` records (cached in between)."""

    def __init__(self, prior_tokens: int = 256, window: int = 512, quantile: float = 0.9,
                 min_samples: int = 16) -> None:
        if prior_tokens < 1:
            raise ValueError(f"prior_tokens must be at least 1, got {prior_tokens}")
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples ({min_samples}) <= window ({window})")
        self.prior_tokens = prior_tokens
        self.quantile = quantile
        self.min_samples = min_samples
        self._lengths: Deque[int] = collections.deque(maxlen=window)
        self._refresh_every = max(1, window // 16)
        self._since_estimate = 0
        self._estimate: Optional[int] = None
        self._lock = threading.Lock()

    def record(self, num_output_tokens: int) -> None:
        """One finished choice's output length."""
        with self._lock:
            self._lengths.append(max(0, int(num_output_tokens)))
            self._since_estimate += 1
            if self._since_estimate >= self._refresh_every:
                self._estimate = None

    def expected(self, max_tokens: int) -> int:
        """The tokens to charge for one choice allowed ``max_tokens``."""
        return max(1, min(max_tokens, self._current()))

    def _current(self) -> int:
        with self._lock:
            if len(self._lengths) < self.min_samples:
                return self.prior_tokens
            if self._estimate is None:
                ordered = sorted(self._lengths)
                index = max(0, math.ceil(self.quantile * len(ordered)) - 1)
                self._estimate = ordered[index]
                self._since_estimate = 0
            return self._estimate


def router_charge(num_prompt_tokens: int, n: int, max_tokens: int,
                  lengths: OutputLengthEstimate) -> int:
    """Tokens the router charges a request of ``n`` choices: its prompt once (the choices
    share it) plus each choice's expected output."""
    return num_prompt_tokens + n * lengths.expected(max_tokens)
