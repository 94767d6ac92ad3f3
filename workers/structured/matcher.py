"""Where one request choice stands in its grammar, and the token masks of a step's rows.

A `RequestGrammar` wraps an xgrammar ``GrammarMatcher``: it advances with every output token
(``accept``), never goes back (a preempted request recomputes its KV, not its tokens), and is
terminated once the grammar is complete and a stop token was accepted. `fill_masks` writes one
bitmask row per constrained row of a step; `TokenMask.apply` sets every token the grammar does
not allow to ``-inf`` on the logits' device (columns past the mask's vocabulary too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from workers.structured.spec import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestGrammar:
    """One choice's matcher. Not thread-safe: only the engine thread touches it."""

    def __init__(self, compiled: "xgr.CompiledGrammar", structured: StructuredOutput) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.structured = structured

    def replay(self, token_ids: Sequence[int]) -> None:
        """Advance over tokens another engine already produced (a migrated request);
        ``ValueError`` naming the first one the grammar does not allow."""
        for position, token in enumerate(token_ids):
            if self._matcher.is_terminated():
                raise ValueError(f"resume_output_ids[{position}] = {token} follows an output "
                                 f"that already completed its {self.structured.kind.value}")
            if not self._matcher.accept_token(token):
                raise ValueError(f"resume_output_ids[{position}] = {token} is not allowed by "
                                 f"the {self.structured.kind.value} after the tokens before it")

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and its stop token was accepted."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


@dataclass(frozen=True)
class TokenMask:
    """The allowed tokens of the constrained rows of one step's logits."""

    bitmask: torch.Tensor  # [>= N, ceil(V / 32)] int32 on the CPU; bit set: allowed
    rows: List[int]  # the constrained rows of the logits [N, V]
    vocab_size: int  # V of the mask: logits columns past it are never allowed

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` ``[N, V']`` (float32) in place on their device."""
        import xgrammar as xgr

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        width = min(logits.shape[-1], self.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=self.rows)
        if logits.shape[-1] > self.vocab_size:  # a padded LM head: no such token exists
            rows = torch.tensor(self.rows, device=logits.device)
            logits[rows, self.vocab_size:] = float("-inf")


def fill_masks(grammars: Sequence[Optional[RequestGrammar]], bitmask: torch.Tensor,
               vocab_size: int) -> TokenMask:
    """Row i of ``bitmask`` filled for ``grammars[i]`` where it is not None."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    for row in rows:
        grammars[row].fill(bitmask, row)  # type: ignore[union-attr]
    return TokenMask(bitmask, rows, vocab_size)
