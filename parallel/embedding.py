"""Vocab-parallel embedding and LM head.

The vocabulary is split into ``tp`` equal ranges of ``ceil(vocab / tp)`` rows; the last range is
padded with zero rows when the vocabulary does not divide evenly. The embedding looks up the ids
in its range, zeroes the others and sums over ranks with one all-reduce. The LM head computes the
logits of its range and gathers them on rank 0, which trims the padding (into a buffer the caller
passes, if any). A tied LM head reuses the embedding's weight, so it is read from the checkpoint
once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel.onednn_linear import Pack, Packed, dense_or_packed, pack_if_possible
from parallel.tp_group import TPGroup
from parallel.weights import TensorSource, copy_checked, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.zeros(self.rows_per_rank, hidden_size, dtype=dtype, device=tp.device),
            requires_grad=False)
        set_weight_loader(self.weight, self.load_weight)

    def load_weight(self, param: nn.Parameter, source: TensorSource, shard_id=None) -> None:
        if source.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor {source.name} has {source.shape[0]} rows, "
                             f"config.json says vocab_size={self.vocab_size}")
        num_rows = max(self.vocab_end - self.vocab_start, 0)
        if num_rows:
            copy_checked(param.data[:num_rows], source.read(0, self.vocab_start, num_rows), source)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, hidden]
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)  # [T, hidden]


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary, assembled on rank 0 (None on other ranks)."""

    packed: Optional[Packed] = None

    def pack_weights(self, pack: Pack = pack_if_possible) -> bool:
        """Multiply with a packed copy of the loaded rows (a tied head keeps the embedding's
        dense rows for lookups, so this copy is its own)."""
        self.packed = pack(self.weight)
        return self.packed is not None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tied word embeddings); nothing is read for the head."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``[N, vocab]`` logits of ``hidden`` ``[N, hidden]`` on rank 0, None elsewhere; every
        rank takes part in the gather. ``out`` (rank 0 only, contiguous ``[N, vocab]`` in the
        weight's dtype): written and returned, so the logits land in a buffer the caller keeps
        (a decode graph's); at TP 1 with a dense weight the GEMM writes it directly."""
        if out is not None and self.tp.world_size == 1 and self.packed is None:
            return torch.mm(hidden, self.weight.t(), out=out)
        local = dense_or_packed(hidden, self.weight, self.packed)  # [N, rows_per_rank]
        logits = self.tp.gather_to_first(local)  # [N, rows_per_rank * tp] on rank 0
        if logits is None:
            return None
        logits = logits[:, :self.vocab_size]
        return logits if out is None else out.copy_(logits)
