"""What a step's model run hands rank 0's sampler: the logits of the rows that sample and, when the
decode graph computed them, each row's greedy id.

Aliasing: after a decode-graph step both tensors are views of the graph's static buffers
(`workers.cuda_graphs`), valid until the next replay overwrites them. Every reader is queued
before that replay, in the device's stream order (on CPU: runs before it): the sampler's
kernels, the copy of the ids to pinned host memory (`workers.sample_copy`; on CPU a copy made at
once), the broadcast of the ids to the other ranks (`workers.rank.share_sampled`) and the next
step's reading of ``ModelRunner.last_sampled``, which happens before that step's replay. So
``last_sampled`` may be the view of the greedy ids only when every row of the step sampled (the
sampled ids are the whole view, and the step that samples next replaces it); the runner copies it
before a replay that would overwrite it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class StepLogits:
    """One step's output on rank 0, row i for the i-th sequence of the plan that samples."""

    logits: torch.Tensor  # [N, vocab] in the model's dtype
    # [N] int64: each row's first maximum of ``logits`` (argmax's answer), where it was computed
    # with them (a decode graph's step in which every row samples); None: not computed.
    greedy_ids: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.greedy_ids is not None and self.greedy_ids.shape != self.logits.shape[:1]:
            raise ValueError(f"greedy_ids has shape {tuple(self.greedy_ids.shape)}, expected "
                             f"one id per logits row ({self.logits.shape[0]})")
