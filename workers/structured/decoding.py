"""Constrained decoding for one engine: grammars per request, masks per step.

The engine asks, in order:

1. ``compile(structured)`` -- the serving engine does it on a thread pool before it queues the
   request (`workers.async_engine`), the offline engine inside ``add_request``;
2. ``grammars(params, n, resumed, compiled)`` at ``add_request``: one `RequestGrammar` per
   choice, each having replayed the resumed tokens;
3. ``masks(grammars)`` after the model ran, before sampling: the bitmasks of the constrained
   rows being sampled, filled on the engine thread (a row's fill costs less than handing it to
   another thread to overlap with the forward pass);
4. ``accept(grammar, token)`` for every sampled token: ``STOP`` when the output is complete.

Guarantees: a step with no constrained row does no mask work and imports nothing of xgrammar;
an engine without constrained requests never imports it. The matchers live where sampling does
(rank 0). Compile errors, and resumed tokens the grammar refuses, are ``ValueError``.
Cost per step with constrained rows: one mask fill per constrained row (a few microseconds for a
JSON schema over a 49k vocabulary, tens for an open regex) plus one masked write over those rows.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import torch

from workers.request import FinishReason
from workers.sampling_params import SamplingParams
from workers.structured.compiler import DEFAULT_CACHE_BYTES, GrammarCache
from workers.structured.matcher import RequestGrammar, TokenMask, fill_masks
from workers.structured.spec import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


def check_structured(params: SamplingParams) -> None:
    """Refuse what a constraint cannot honour, naming the fields: ``ignore_eos`` and
    ``min_tokens`` hold back the stop token that ends a complete output."""
    if params.structured is None:
        return
    kind = params.structured.kind.value
    if params.ignore_eos:
        raise ValueError(f"ignore_eos cannot be combined with a {kind} constraint: a complete "
                         f"output ends with the end-of-sequence token")
    if params.min_tokens:
        raise ValueError(f"min_tokens cannot be combined with a {kind} constraint: a complete "
                         f"output may be shorter, and ends with the end-of-sequence token")


class StructuredDecoding:
    """``tokenizer`` and ``vocab_size`` (the model's logits) are the compiler's;
    ``stop_token_ids`` (the model's EOS ids) end a complete output; bitmasks are kept for up to
    ``max_rows`` rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_rows: int, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._max_rows = max_rows
        self._cache_bytes = cache_bytes
        self._cache: Optional[GrammarCache] = None
        self._cache_lock = threading.Lock()  # the serving engine compiles on several threads
        self._bitmask: Optional[torch.Tensor] = None  # [max_rows, ceil(V / 32)] int32

    @property
    def cache(self) -> GrammarCache:
        with self._cache_lock:
            if self._cache is None:
                self._cache = GrammarCache(self._tokenizer, self.vocab_size,
                                           self._stop_token_ids, self._cache_bytes)
            return self._cache

    def compile(self, structured: StructuredOutput) -> "xgr.CompiledGrammar":
        """Thread-safe; ``ValueError`` when the spec does not compile."""
        return self.cache.compile(structured)

    def grammars(self, params: SamplingParams, num_choices: int, resumed: Sequence[int],
                 compiled: Optional["xgr.CompiledGrammar"] = None
                 ) -> List[Optional[RequestGrammar]]:
        """One matcher per choice (Nones without a constraint), advanced over ``resumed``;
        compiles here unless ``compiled`` is given."""
        structured = params.structured
        if structured is None:
            return [None] * num_choices
        check_structured(params)
        if compiled is None:
            compiled = self.compile(structured)
        grammars: List[Optional[RequestGrammar]] = []
        for _ in range(num_choices):
            grammar = RequestGrammar(compiled, structured)
            grammar.replay(resumed)
            grammars.append(grammar)
        return grammars

    def masks(self, grammars: Sequence[Optional[RequestGrammar]]) -> Optional[TokenMask]:
        """The masks of a step's sampled rows (``grammars[i]``: row i's, None when
        unconstrained); None, at no cost, when no row is constrained."""
        if all(grammar is None for grammar in grammars):
            return None
        return fill_masks(grammars, self._bitmask_rows(len(grammars)), self.vocab_size)

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        """A bitmask of at least ``num_rows`` rows, reused from step to step."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, self._max_rows),
                                                       self.vocab_size)
        return self._bitmask

    @staticmethod
    def accept(grammar: RequestGrammar, token_id: int) -> Optional[FinishReason]:
        """Advance ``grammar`` over a sampled token: ``STOP`` when the output is complete,
        ``ABORT`` (logged: the mask failed) when the grammar refuses the token, else None."""
        if not grammar.accept(token_id):
            logger.error("token %d was sampled against its %s constraint; the request is "
                         "aborted", token_id, grammar.structured.kind.value)
            return FinishReason.ABORT
        return FinishReason.STOP if grammar.is_terminated else None
