"""Runs one rank's model shard on a step plan: the same code on every rank.

The runner mirrors each sequence's block table and cached length from the plans it has run, builds
the attention metadata (through the model's attention backend), runs the model and, on rank 0,
returns the logits of the sequences that need sampling (``StepLogits``; a decode graph's step
in which every row samples adds their greedy ids, computed in the graph).

Two ways to build a step's inputs, chosen by the backend:

- from host lists (the torch backend): the runner keeps each block table as a Python list and the
  backend builds padded gather indices from them;
- on the device (backends that read block tables, the triton one): the tables live on the device
  (``DeviceBlockTables``) and change by each plan's diffs; a step sends its ints in one copy and
  builds positions, slots and context lengths there (``build_device_step``). Decode-only steps
  may then replay a CUDA graph (``DecodeGraphs``) instead of launching every kernel.

A plan's token id may be a placeholder for a token sampled by the previous step whose id only the
device has (the overlapped step loop): it is taken from ``last_sampled`` on the device, so no
rank waits for the host to learn it. ``last_sampled`` may view a decode graph's static greedy ids
(`workers.step_logits`): before a replay in which not every row samples, the runner copies it.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

import torch

from kv.attention.metadata import SeqSlice
from kv.attention.block_table_metadata import DeviceSeq, build_device_step
from kv.attention.device_block_tables import DEFAULT_NUM_ROWS, DeviceBlockTables
from kv.host_staging import tensor_on
from kv.kv_cache import KVCache
from workers.cuda_graphs import DecodeGraphs
from workers.models.llama import LlamaForCausalLM
from workers.step_logits import StepLogits
from workers.step_plan import NewSeqStep, StepPlan

logger = logging.getLogger(__name__)


class ModelRunner:
    """``max_model_len`` sizes the device block tables' columns and ``max_graph_batch`` (the
    scheduler's ``max_num_seqs``) their rows; ``cuda_graphs`` asks for decode graphs (used on
    CUDA with a backend that reads block tables, else refused in the log once)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 max_model_len: Optional[int] = None, cuda_graphs: bool = False,
                 max_graph_batch: int = 256) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self._block_tables: Dict[int, List[int]] = {}  # host mirrors (backends without tables)
        self._num_computed: Dict[int, int] = {}
        self.tables: Optional[DeviceBlockTables] = None
        self.graphs: Optional[DecodeGraphs] = None
        # The ids sampled by the last step that shared them (``[N]`` on the device): a plan's
        # placeholder ids (`workers.request.placeholder`) name rows of it.
        self.last_sampled: Optional[torch.Tensor] = None
        if model.attention.reads_block_tables:
            max_len = max_model_len or model.config.max_position_embeddings
            # A row for every sequence the scheduler may run: a table that has to grow makes
            # every decode graph be captured again.
            self.tables = DeviceBlockTables(-(-max_len // self.block_size), device,
                                            num_rows=max(max_graph_batch, DEFAULT_NUM_ROWS),
                                            padding_block=kv_cache.scratch_block or 0)
            if cuda_graphs:
                self.graphs = DecodeGraphs.create(model, kv_cache, self.tables, max_len,
                                                  max_graph_batch)
        elif cuda_graphs and device.type == "cuda":
            logger.info("CUDA graphs need the triton attention backend; the %s backend runs "
                        "eager", model.attention.name)
        model.attention.prepare(kv_cache, model.config.num_heads)

    @torch.inference_mode()
    def capture_graphs(self) -> List[int]:
        """Capture every decode graph now (the rank is starting: no step waits for it); the
        sizes captured, largest first ([] without graphs)."""
        if self.graphs is None:
            return []
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        start = time.perf_counter()
        sizes = self.graphs.capture_all()
        if cuda:
            torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs (up to %d sequences) in %.1f s, %.2f GiB",
                    len(sizes), max(sizes), time.perf_counter() - start,
                    ((torch.cuda.memory_reserved(self.device) if cuda else 0) - reserved) / 2**30)
        return sizes

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Optional[StepLogits]:
        """Run ``plan``; returns the ``[num sampled seqs, vocab]`` logits on rank 0 (with their
        greedy ids after a decode graph's step in which every row samples), else None. After a
        graph's step they view its static outputs: read them before the next ``execute``."""
        for seq_id in plan.freed_ids:
            self._block_tables.pop(seq_id, None)
            self._num_computed.pop(seq_id, None)
            if self.tables is not None:
                self.tables.free(seq_id)
        if not plan.seqs:
            return None
        if self.tables is None:
            hidden, rows = self._run_from_lists(plan)
        else:
            seqs, input_ids, last_rows = self._update_tables(plan)
            if self.graphs is not None and self.graphs.can_run(seqs):
                return self._run_graph(seqs, input_ids, last_rows)
            step = build_device_step(self.tables, seqs, input_ids, last_rows, self.block_size,
                                     self.model.config.layer_windows)
            ids = self._with_sampled(step.input_ids, input_ids)
            hidden, rows = self.model(ids, step.metadata, self.kv_cache), step.logit_rows
        logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
        return None if logits is None else StepLogits(logits)

    def _run_from_lists(self, plan: StepPlan) -> Tuple[torch.Tensor, torch.Tensor]:
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
        tokens = self._with_sampled(tensor_on(input_ids, torch.long, self.device), input_ids)
        hidden = self.model(tokens, metadata, self.kv_cache)  # [T, hidden]
        return hidden, tensor_on(last_rows, torch.long, self.device)

    def _update_tables(self, plan: StepPlan) -> Tuple[List[DeviceSeq], List[int], List[int]]:
        """The device tables and cached lengths updated by ``plan``; its sequences, their input
        ids (flat) and the index of each sampled sequence's last token in them."""
        assert self.tables is not None
        seqs, input_ids, last_rows = [], [], []
        for step in plan.seqs:
            if isinstance(step, NewSeqStep):
                self.tables.add(step.seq_id, step.block_ids)
                self._num_computed[step.seq_id] = step.num_computed
            else:
                self.tables.extend(step.seq_id, step.new_block_ids)
            num_computed = self._num_computed[step.seq_id]
            seqs.append(DeviceSeq(self.tables.row_of(step.seq_id), len(step.token_ids),
                                  num_computed))
            input_ids.extend(step.token_ids)
            self._num_computed[step.seq_id] = num_computed + len(step.token_ids)
            if step.needs_logits:
                last_rows.append(len(input_ids) - 1)
        self.tables.flush()
        return seqs, input_ids, last_rows

    def _run_graph(self, seqs: List[DeviceSeq], input_ids: List[int],
                   last_rows: List[int]) -> Optional[StepLogits]:
        """A decode-only step through the graphs. Every row samples: the graph's views as they
        are (the step's sampling replaces ``last_sampled``); else the sampled rows' logits,
        gathered, and ``last_sampled`` copied first if the replay would overwrite it."""
        assert self.graphs is not None
        every_row_samples = len(last_rows) == len(seqs)
        if not every_row_samples and self.graphs.holds(self.last_sampled):
            assert self.last_sampled is not None
            self.last_sampled = self.last_sampled.clone()
        out = self.graphs.run(seqs, input_ids,
                              fill=lambda ids: self._with_sampled(ids, input_ids))
        if out is None or every_row_samples:
            return out
        return StepLogits(out.logits[tensor_on(last_rows, torch.long, self.device)])

    def _with_sampled(self, ids: torch.Tensor, host_ids: List[int]) -> torch.Tensor:
        """``ids`` (``host_ids`` on the device) with each placeholder replaced, on the device, by
        the row of ``last_sampled`` it names; ``ids`` itself when there is none."""
        if not host_ids or min(host_ids) >= 0:
            return ids
        if self.last_sampled is None:
            raise RuntimeError("the plan has placeholder ids but no step has shared its "
                               "sampled ids")
        rows = (-1 - ids).clamp_(0, self.last_sampled.numel() - 1)
        return torch.where(ids < 0, self.last_sampled[rows], ids)
