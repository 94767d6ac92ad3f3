"""Runs one rank's model shard on a step plan: the same code on every rank.

The runner mirrors each sequence's block table and cached length from the plans it has run, builds
the attention metadata (through the model's attention backend), runs the model and, on rank 0,
returns the logits of the sequences that need sampling.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from kv.attention_metadata import SeqSlice
from kv.host_staging import tensor_on
from kv.kv_cache import KVCache
from workers.models.llama import LlamaForCausalLM
from workers.step_plan import NewSeqStep, StepPlan


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self._block_tables: Dict[int, List[int]] = {}
        self._num_computed: Dict[int, int] = {}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Optional[torch.Tensor]:
        """Run ``plan``; returns ``[num sampled seqs, vocab]`` logits on rank 0, else None."""
        for seq_id in plan.freed_ids:
            self._block_tables.pop(seq_id, None)
            self._num_computed.pop(seq_id, None)
        if not plan.seqs:
            return None
        slices, input_ids, last_rows = [], [], []
        for step in plan.seqs:
            if isinstance(step, NewSeqStep):
                self._block_tables[step.seq_id] = list(step.block_ids)
                self._num_computed[step.seq_id] = step.num_computed
            else:
                self._block_tables[step.seq_id].extend(step.new_block_ids)
            num_computed = self._num_computed[step.seq_id]
            slices.append(SeqSlice(len(step.token_ids), num_computed,
                                   self._block_tables[step.seq_id]))
            input_ids.extend(step.token_ids)
            self._num_computed[step.seq_id] = num_computed + len(step.token_ids)
            if step.needs_logits:
                last_rows.append(len(input_ids) - 1)
        metadata = self.model.attention.build_metadata(slices, self.block_size, self.device,
                                                       self.model.config.layer_windows)
        tokens = tensor_on(input_ids, torch.long, self.device)
        hidden = self.model(tokens, metadata, self.kv_cache)  # [T, hidden]
        rows = tensor_on(last_rows, torch.long, self.device)
        return self.model.compute_logits(hidden[rows])
