"""The per-step plan rank 0 sends to every rank, and how it travels (a CPU-group broadcast).

New sequences go in full (their tokens to compute, the cached length, the whole block table);
known ones as diffs (this step's tokens, the blocks added since the last step). Every rank keeps a
mirror of the block tables, so a decode step costs a few bytes per sequence. A token whose id only
the device knows yet (sampled by the previous step) travels as a placeholder (a negative id).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from kv.tiers.ops import TierOp


@dataclass(frozen=True)
class NewSeqStep:
    seq_id: int
    token_ids: Tuple[int, ...]  # tokens computed this step
    num_computed: int  # tokens already in the cache (a cached prefix)
    block_ids: Tuple[int, ...]  # the whole block table
    needs_logits: bool  # this step reaches the end of the sequence: sample from it


@dataclass(frozen=True)
class KnownSeqStep:
    seq_id: int
    token_ids: Tuple[int, ...]
    new_block_ids: Tuple[int, ...]  # appended to the mirrored block table
    needs_logits: bool


SeqStep = Union[NewSeqStep, KnownSeqStep]


@dataclass(frozen=True)
class StepPlan:
    """One engine step. ``freed_ids`` are dropped from the mirrors before ``seqs`` run.

    ``tier_ops`` are queued on every rank's transfer engine before the model runs.
    ``wait_spill_reads``: the model writes a block a queued spill may still be reading, so the
    ranks first wait for the device side of their spills. ``wait_transfers``: the ranks wait for
    every queued transfer before agreeing on what finished (a step with nothing to run).
    ``share_sampled``: once the model has run, rank 0 broadcasts the ids it sampled (one per
    sequence with ``needs_logits``, in plan order) over the device group; a later plan's
    placeholder ids (`workers.request.placeholder`) name their rows."""

    seqs: Tuple[SeqStep, ...] = ()
    freed_ids: Tuple[int, ...] = ()
    tier_ops: Tuple[TierOp, ...] = ()
    wait_spill_reads: bool = False
    wait_transfers: bool = False
    share_sampled: bool = False
    shutdown: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


def broadcast_plan(plan: Optional[StepPlan], cpu_group: Optional[dist.ProcessGroup],
                   src: int = 0) -> StepPlan:
    """Send ``plan`` from ``src`` (pass None on the other ranks); every rank returns it."""
    if cpu_group is None:
        assert plan is not None
        return plan
    global_src = dist.get_global_rank(cpu_group, src)
    if plan is not None:
        payload = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        dist.broadcast(size, src=global_src, group=cpu_group)
        dist.broadcast(payload, src=global_src, group=cpu_group)
        return plan
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=global_src, group=cpu_group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=global_src, group=cpu_group)
    return pickle.loads(payload.numpy().tobytes())
