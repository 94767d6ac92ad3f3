"""CUDA graphs of decode-only steps: one graph per padded batch size, replayed instead of launching
every kernel of every layer (hundreds of launches per step, which a small model's decode cannot
hide behind the GPU's work). A graph holds the whole step up to the greedy ids: the model, the LM
head (with its gather to rank 0 under TP) and each row's first maximum.

A graph replays fixed addresses and shapes, so a decode step goes through static buffers:

    static (device)   input_ids [max_B]   rows [max_B]   num_computed [max_B]
    a step of B decodes fills the first B entries and pads up to the graph's size S >= B:
      padded rows     input id 0, the tables' padding row (the KV cache's scratch block),
                      0 tokens computed: they write one K/V row into the scratch block and attend
                      to it alone; their outputs are never read
    outputs (rank 0)  logits [max_B, vocab] in the model's dtype, greedy ids [max_B] int64 (and
                      the maxima [max_B]): one set shared by every size, allocated once outside
                      the graphs' memory pool (max_B x vocab, not a copy per size); a step reads
                      the first B rows, valid until the next replay (`workers.step_logits`)

Inside the graph everything else is built on the device from those buffers: the block table
(``DeviceBlockTables`` rows gathered, every column), positions, slots and context lengths. The
decode kernel's split count is fixed per size from the longest context the model allows, so the
launch never depends on the step; which keys a split walks does, and each program reads it from
its sequence's context length on the device (`kv.attention.triton_paged.decode_split_range`):
a short context is spread over the splits in tiles and the splits past its end exit at once.
The all-reduces of a TP group are captured too (NCCL), and so are the timing events of the ones
its timer samples (`parallel.collective_timer`): each replay times them again, and the next
replay of the same graph reads them, so all-reduce latency is measured in decode steps too.

Every size is captured while the rank starts (`capture_all`, as vLLM and SGLang do), largest
first so that the smaller graphs reuse its pool's memory, each after a warm-up run of the same
step on a side stream (one for all sizes). The start-up batches are padding rows alone, which
write into the scratch block only. A capture in the middle of traffic would hold up the step that
first needs a size (tens of milliseconds of warm-up and capture for a real model). The ranks of a
group capture the same sizes in the same order, so the all-reduces inside match. Graphs are
dropped, with their memory pool, when the device block tables are reallocated (``version``) and
captured again when next needed; the runner gives the tables a row for every sequence the
scheduler may run, so that does not happen in normal use.
Constructed with ``capture=False``, ``run`` executes the same static-buffer forward eagerly: how
the padding, the static metadata and the outputs are tested on CPU (under Triton's interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kv.attention.block_table_metadata import BlockTableMetadata, DeviceSeq
from kv.attention.device_block_tables import PADDING_ROW, DeviceBlockTables
from kv.host_staging import PinnedStaging
from kv.kv_cache import KVCache
from parallel.collective_timer import GraphTimings
from workers.models.llama import LlamaForCausalLM
from workers.sampler import first_max
from workers.step_logits import StepLogits

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> List[int]:
    """Padded batch sizes with a graph: 1, 2, 4, then every multiple of 8 up to ``max_batch``
    (a step pads to the next one: at most 7 wasted rows)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """Decode-only steps of up to ``max_batch`` sequences through captured graphs."""

    @classmethod
    def create(cls, model: LlamaForCausalLM, kv_cache: KVCache, tables: DeviceBlockTables,
               max_model_len: int, max_batch: int) -> Optional["DecodeGraphs"]:
        """Graphs on CUDA; None (with a log line) elsewhere."""
        if kv_cache.data.device.type != "cuda":
            logger.info("CUDA graphs run on CUDA only: decode steps on %s run eager",
                        kv_cache.data.device.type)
            return None
        return cls(model, kv_cache, tables, max_model_len, max_batch, capture=True)

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, tables: DeviceBlockTables,
                 max_model_len: int, max_batch: int, capture: bool) -> None:
        if kv_cache.scratch_block is None:
            raise ValueError("decode graphs need a KV cache with a scratch block for padded rows")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        device = kv_cache.data.device
        self.model, self.kv_cache, self.tables = model, kv_cache, tables
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.capture = capture
        self._static = torch.zeros(3, max_batch, dtype=torch.long, device=device)
        self._staging = PinnedStaging((3, max_batch), torch.long, device)
        self._arange = torch.arange(max_batch, dtype=torch.int32, device=device)
        self._ones = torch.ones(max_batch, dtype=torch.int32, device=device)
        self._none = torch.zeros(0, dtype=torch.int32, device=device)
        self._outputs = _static_outputs(model, max_batch) if model.tp.is_first else None
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, GraphTimings]] = {}
        self._pool = None
        self._warmup_stream: Optional[torch.cuda.Stream] = None
        self._tables_version = tables.version
        self.num_runs = 0  # steps run through the static buffers (replayed or eager)

    def can_run(self, seqs: Sequence[DeviceSeq]) -> bool:
        return 0 < len(seqs) <= self.sizes[-1] and all(s.query_len == 1 for s in seqs)

    def run(self, seqs: Sequence[DeviceSeq], input_ids: Sequence[int],
            fill: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
            ) -> Optional[StepLogits]:
        """A decode-only step (``can_run``): on rank 0 the logits ``[B, vocab]`` and greedy ids
        ``[B]`` of its rows, one per seq, as views of the static outputs (valid until the next
        run); None on the other ranks. ``fill`` maps the staged ids to the ids to run
        (placeholders taken from the device), written into the graph's input buffer before the
        replay."""
        size = self.sizes[bisect.bisect_left(self.sizes, len(seqs))]
        self._stage(seqs, input_ids, size)
        if fill is not None:
            staged = self._static[0, :len(seqs)]
            filled = fill(staged)
            if filled is not staged:
                staged.copy_(filled)
        self.num_runs += 1
        if self.tables.version != self._tables_version:  # the graphs read a freed tensor
            self._drop_graphs()
        if not self.capture:
            self._forward(size)
        else:
            if size not in self._graphs:
                self._graphs[size] = self._capture(size)
            graph, timings = self._graphs[size]
            with timings.replaying():
                graph.replay()
        return self._step_logits(len(seqs))

    def holds(self, tensor: Optional[torch.Tensor]) -> bool:
        """Whether ``tensor`` views the static greedy ids (the next run overwrites it)."""
        return (tensor is not None and self._outputs is not None
                and tensor.untyped_storage().data_ptr()
                == self._outputs.greedy_ids.untyped_storage().data_ptr())

    def capture_all(self) -> List[int]:
        """Capture the graph of every size now, largest first, from batches of padding rows
        (they write into the scratch block alone: no real block changes). Returns the sizes in
        the order run. Without ``capture`` each size's forward runs once, eagerly. Before the
        first step: it overwrites the static outputs."""
        order = sorted(self.sizes, reverse=True)
        for size in order:
            self._stage((), (), size)
            if not self.capture:
                self._forward(size)
            elif size not in self._graphs:
                self._graphs[size] = self._capture(size)
        return order

    def replay_host_s(self, size: int) -> float:
        """Host seconds that launching one replay of the graph for ``size`` (one of ``sizes``)
        takes, the device idle before it, with padding rows staged (they write the scratch block
        alone): what a decode step costs the host to launch. For diagnostics, between steps:
        it overwrites the static outputs, so no step's outputs may still be unread."""
        self._stage((), (), size)
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, _ = self._graphs[size]
        torch.cuda.synchronize(self._static.device)
        started = time.perf_counter()
        graph.replay()
        elapsed = time.perf_counter() - started
        torch.cuda.synchronize(self._static.device)
        return elapsed

    def _drop_graphs(self) -> None:
        """Forget every graph, and their memory pool with them: a pool outlives its last graph
        (cuBLAS keeps a workspace in it), and capturing into it again then fails the caching
        allocator's assertion that the pool is still in use."""
        self._graphs.clear()
        self._pool = None
        self._tables_version = self.tables.version

    def _stage(self, seqs: Sequence[DeviceSeq], input_ids: Sequence[int], size: int) -> None:
        """One host-to-device copy of the step's ids, rows and cached lengths, padded to
        ``size`` (through persistent pinned buffers)."""
        padding = size - len(seqs)
        self._staging.copy((list(input_ids) + [0] * padding,
                            [s.row for s in seqs] + [PADDING_ROW] * padding,
                            [s.num_computed for s in seqs] + [0] * padding), self._static)

    def _step_logits(self, num_rows: int) -> Optional[StepLogits]:
        if self._outputs is None:
            return None
        return StepLogits(self._outputs.logits[:num_rows], self._outputs.greedy_ids[:num_rows])

    def _forward(self, size: int) -> None:
        """The model, the LM head and the greedy ids over the first ``size`` static rows, into
        the first ``size`` rows of the static outputs (rank 0; the other ranks' part of the LM
        head's gather is in their graphs alike); everything it reads is static."""
        input_ids, rows, positions = self._static[:, :size]  # [S] each
        block_table = self.tables.gather(rows)  # [S, max_blocks]
        block_size = self.kv_cache.spec.block_size
        slots = (block_table.gather(1, (positions // block_size)[:, None])[:, 0].long()
                 * block_size + positions % block_size)  # [S]
        context_len = (positions + 1).to(torch.int32)
        by_window = {}
        for window in dict.fromkeys(self.model.config.layer_windows):
            by_window[window] = BlockTableMetadata(
                num_tokens=size, block_size=block_size, positions=positions, slot_mapping=slots,
                block_table=block_table, query_start=self._arange[:size],
                query_len=self._ones[:size], context_len=context_len,
                decode_ids=self._arange[:size], prefill_ids=self._none,
                cached_prefill_ids=self._none, fresh_prefills=(), num_decodes=size,
                max_decode_keys=min(window or self.max_model_len, self.max_model_len),
                max_query_len=0, sliding_window=window)
        metadata = [by_window[w] for w in self.model.config.layer_windows]
        hidden = self.model(input_ids, metadata, self.kv_cache)  # [S, hidden]
        out = self._outputs
        logits = self.model.compute_logits(hidden, None if out is None else out.logits[:size])
        if out is not None:  # [S, vocab] into greedy ids [S]
            first_max(logits, out=(out.maxima[:size], out.greedy_ids[:size]))

    def _capture(self, size: int) -> Tuple[torch.cuda.CUDAGraph, GraphTimings]:
        # Warm-up on a side stream (compiles the kernels, sets up cuBLAS): it runs the staged
        # step itself, and the replay that follows writes the same K/V again.
        if self._warmup_stream is None:  # one for every size: cuBLAS keeps a workspace per
            self._warmup_stream = torch.cuda.Stream()  # stream it ever ran on
        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the KV tiers' copy thread may use CUDA while this thread captures.
        with self.model.tp.all_reduce_timer.capturing() as timings, \
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._forward(size)
        self._pool = graph.pool()
        logger.debug("captured the decode graph for %d sequences", size)
        return graph, timings


@dataclass(frozen=True)
class _StaticOutputs:
    """Rank 0's outputs of every decode graph, rows ``[:S]`` written by the graph of size S."""

    logits: torch.Tensor  # [max_B, vocab], the model's dtype
    maxima: torch.Tensor  # [max_B], the model's dtype: each row's largest logit
    greedy_ids: torch.Tensor  # [max_B] int64: the index of each row's first maximum


def _static_outputs(model: LlamaForCausalLM, max_batch: int) -> _StaticOutputs:
    """The outputs, allocated (and their size logged) once: every graph's pool lies apart."""
    weight = model.lm_head.weight
    vocab, device = model.config.vocab_size, weight.device
    outputs = _StaticOutputs(
        torch.zeros(max_batch, vocab, dtype=weight.dtype, device=device),
        torch.zeros(max_batch, dtype=weight.dtype, device=device),
        torch.zeros(max_batch, dtype=torch.long, device=device))
    num_bytes = sum(t.numel() * t.element_size()
                    for t in (outputs.logits, outputs.maxima, outputs.greedy_ids))
    logger.info("decode graphs: static logits of %d x %d %s and greedy ids, %.1f MiB",
                max_batch, vocab, str(weight.dtype).replace("torch.", ""), num_bytes / 2**20)
    return outputs
