"""The engine: requests in, streamed outputs out, one scheduled step at a time.

Rank 0 lives in this process: it schedules, broadcasts the step plan to ranks 1..N-1 (local
processes here; Ray actors in serving), runs its own model shard on the same plan, samples and
detokenizes. ``step`` returns what changed for each request; ``LLM`` wraps it for offline use.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kv.kv_manager import KVUsage
from kv.tiers.ops import TierOp, TierOpResults
from parallel.collective_errors import sum_counts
from parallel.rendezvous import RendezvousSocket
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.engine_outputs import RequestOutput, StepRecord, request_output, step_record
from workers.engine_sizing import check_model, context_length, fit_context_to_pool
from workers.multiproc import RANK_STOP_S, RankLauncher, RankProcesses
from workers.rank import RankReport, build_rank, execute_plan, rank_report
from workers.rank_configs import rank_configs
from workers.request import FinishReason, Request, RequestId
from workers.sampler import SampledToken
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig
from workers.keepalive import PlanKeepalive
from workers.request_intake import check_resume, check_token_ids, choice_generator, tokenize
from workers.step_logits import StepLogits
from workers.step_plan import StepPlan, broadcast_plan
from workers.step_sampling import LaunchedStep, StepSampler
from workers.structured.decoding import StructuredDecoding
from workers.tier_setup import build_kv_manager, save_token_index, tier_stats
from workers.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, launcher: RankLauncher = RankProcesses,
                 init_host: str = "127.0.0.1", bind_cpu_cores: bool = False) -> None:
        """``launcher`` starts ranks 1..N-1 from their configs (local processes by default; the
        serving layer passes Ray actors); ``init_host`` is the address rank 0 listens on;
        ``bind_cpu_cores``: every CPU rank, this process's included, claims cores of its own
        (`parallel.cpu_binding`; the serving layer's processes are the ranks')."""
        self.config = config
        self.model_dir, self.model_config = check_model(config)  # before any rank starts
        self.tokenizer = load_tokenizer(self.model_dir)
        # Rank 0 listens from now on: the port cannot be taken while the other ranks start.
        self._rendezvous = RendezvousSocket(init_host) if config.tp_size > 1 else None
        try:
            sized = rank_configs(config, self.model_dir, self.model_config,
                                 context_length(config, self.model_config), self._rendezvous,
                                 bind_cpu_cores)
            self.max_model_len, self._disk_lock = sized.max_model_len, sized.disk_lock
            self._children = launcher(sized.ranks[1:]) if config.tp_size > 1 else None
            self.rank = build_rank(sized.ranks[0], check_peers=(
                self._children.check if self._children is not None else None))
        finally:
            if self._rendezvous is not None:
                self._rendezvous.close()  # rank 0's store has its own descriptor
        if self._children is not None:
            self._children.wait_ready()
        self.num_kv_blocks = self.rank.runner.kv_cache.spec.num_blocks  # as the ranks sized it
        if config.gpu_memory_utilization is not None:
            self._fit_context_to_sized_pool()
        self._tier_config = sized.ranks[0].tiers
        kv = build_kv_manager(config, self.num_kv_blocks, self._tier_config,
                              self.rank.tiers.recovered_disk_tags if self.rank.tiers else {})
        self._last_snapshot = time.monotonic()
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            self.model_config.shared_window), kv)
        if kv.tiers is not None:
            self.scheduler.run_transfers = self._run_transfers_now
        self._requests: Dict[RequestId, List[Request]] = {}  # by the caller's id: its choices
        self._detok: Dict[RequestId, IncrementalDetokenizer] = {}
        self._aborted: List[Request] = []
        self._seq_ids = itertools.count()
        self._device = torch.device(sized.ranks[0].device)
        self._generator = torch.Generator(self._device).manual_seed(config.seed)
        self.structured = StructuredDecoding(self.tokenizer, self.model_config.vocab_size,
                                             self.model_config.eos_token_ids, config.max_num_seqs)
        overlap = (config.async_scheduling if config.async_scheduling is not None
                   else self._device.type == "cuda")
        self._sampler = StepSampler(self.rank, self.structured, self.model_config.eos_token_ids,
                                    self.max_model_len, overlap, config.max_num_seqs)
        self._launched: Optional[LaunchedStep] = None  # sampled, ids not yet read
        self.step_records: List[StepRecord] = []  # only with config.record_steps
        self._is_shut_down = False
        # Ranks 1..N-1 of an idle group must hear from rank 0 within the step timeout.
        self._keepalive = None if self._children is None else PlanKeepalive(
            self._send_keepalive,
            lambda: not self._has_outstanding_transfers(), config.step_timeout_s / 3)

    def _fit_context_to_sized_pool(self) -> None:
        """The context, fitted to the pool the ranks sized from their free memory; the ranks
        are stopped when it does not fit."""
        try:
            self.max_model_len = fit_context_to_pool(self.config, self.max_model_len,
                                                     self.num_kv_blocks)
        except ValueError:
            self._stop_ranks()
            raise

    # ----- requests -----

    def add_request(self, prompt: Union[str, Sequence[int]], params: SamplingParams,
                    request_id: Optional[str] = None,
                    resume_output_ids: Sequence[int] = (),
                    grammar: Optional["xgr.CompiledGrammar"] = None) -> RequestId:
        """Queue a request (text, or token ids); raises ``ValueError`` on bad input.

        ``resume_output_ids``: the tokens another engine already produced for this request (a
        migrated request, n=1). They count as output (``max_tokens``, ``min_tokens``,
        penalties, stop strings across the cut) and their text as already emitted: the outputs
        continue where that engine stopped. A greedy request continues exactly in fp32 (in bf16 the
        prefill of the resumed tokens rounds otherwise than their decodes did); a seeded one
        draws from a seed derived from its seed and the number of resumed tokens (reproducible
        for the same cut, not the draws the uninterrupted run would have made).

        ``grammar``: ``params.structured`` compiled ahead by ``self.structured.compile`` (the
        serving engine compiles off its engine thread); None: compiled here when needed."""
        token_ids = tokenize(prompt, self.tokenizer, self.model_config.vocab_size, self.model_dir)
        vocab = self.model_config.vocab_size
        resume = check_resume(list(resume_output_ids), params, vocab)
        if len(token_ids) + len(resume) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids) + len(resume)} tokens; the model's "
                             f"context is {self.max_model_len} tokens, prompt plus at least one "
                             f"output")
        rid = RequestId(request_id or uuid.uuid4().hex)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        check_token_ids(params, vocab)
        grammars = self.structured.grammars(params, params.n, resume, grammar)
        choices: List[Request] = []
        for index in range(params.n):
            child_id = rid if params.n == 1 else RequestId(f"{rid}#{index}")
            request = Request(child_id, next(self._seq_ids), token_ids, params,
                              choice_generator(params, index, len(resume), self._device,
                                               self._generator),
                              self.model_config.eos_token_ids, parent_id=rid, index=index,
                              prefill_leader=choices[0] if choices else None)
            request.resume(resume)
            request.grammar = grammars[index]
            choices.append(request)
            if self.tokenizer is not None:
                detok = self._detok[child_id] = IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output)
                for count, token in enumerate(resume, start=1):  # replays the other engine's
                    detok.add_token(token, can_stop=count > params.min_tokens)
            self.scheduler.add(request)
        self._requests[rid] = choices
        return rid

    def abort(self, request_id: str) -> None:
        """Finish every unfinished choice of ``request_id`` (unknown ids are ignored)."""
        for request in self._requests.get(RequestId(request_id), ()):
            if not request.is_finished:
                self.scheduler.finish(request, FinishReason.ABORT)
                self._aborted.append(request)

    def has_unfinished(self) -> bool:
        """Requests in flight, or tier transfers not yet committed (steps finish them)."""
        tiers = self.scheduler.kv.tiers
        return (self.scheduler.has_unfinished() or bool(self._aborted)
                or self._launched is not None or (tiers is not None and tiers.has_outstanding))

    def idle_wait_s(self) -> float:
        """How long the next step may wait: with no request in flight and only spills that
        ``--kv-spill-gbps`` holds back left, until the bound pays for the next one; else 0 (a
        step has work). Callers wait instead of running empty steps back to back. At most a
        third of the step timeout: ranks 1..N-1 must hear from rank 0 within it (the keepalive
        is off while transfers are outstanding)."""
        tiers = self.scheduler.kv.tiers
        if (tiers is None or self.scheduler.has_unfinished() or self._aborted
                or self._launched is not None):
            return 0.0
        return min(tiers.paced_wait_s(), self.config.step_timeout_s / 3)

    def wait_while_idle(self, max_s: Optional[float] = None) -> None:
        """Sleep ``idle_wait_s()`` (at most ``max_s``) before the next step, instead of an
        empty one, for callers that step the engine in a loop of their own."""
        wait_s = self.idle_wait_s()
        if max_s is not None:
            wait_s = min(wait_s, max_s)
        if wait_s > 0:
            time.sleep(wait_s)

    # ----- stepping -----

    def step(self) -> List[RequestOutput]:
        """Schedule, run and sample one step; outputs of every request that changed."""
        with self._keepalive.lock if self._keepalive is not None else contextlib.nullcontext():
            return self._step()

    def _step(self) -> List[RequestOutput]:
        """Schedule and launch step N, then read step N-1's sampled ids and do their host work
        while the device computes N (the overlapped loop), or read N's at once (serial)."""
        started = time.perf_counter()
        self._maybe_snapshot()
        outputs = []
        if self._launched is not None and self._launched.needs_ids_first():
            outputs = self._read_launched()
        scheduled = self.scheduler.schedule()
        plan = self._sampler.plan_to_send(scheduled.plan)
        step_logits, tier_results = self._execute(plan)
        launched = self._sampler.launch(scheduled, plan, step_logits)
        self.scheduler.update(scheduled, tier_results)
        outputs += [self._finish_output(r) for r in self._aborted + list(scheduled.finished)]
        self._aborted = []
        outputs += self._read_launched()
        self._launched = launched
        if not self._sampler.overlap:
            outputs += self._read_launched()
        if plan.seqs and self.config.record_steps:  # grows without bound: for benchmarks
            self.step_records.append(step_record(scheduled, time.perf_counter() - started))
        return outputs

    def _read_launched(self) -> List[RequestOutput]:
        """The outputs of the launched step's sampled ids (none launched: none)."""
        launched, self._launched = self._launched, None
        if launched is None:
            return []
        return [self._append(request, token) for request, token in launched.read()]

    def _execute(self, plan: StepPlan) -> Tuple[Optional[StepLogits], Optional[TierOpResults]]:
        tiers = self.scheduler.kv.tiers
        if not (plan.seqs or plan.freed_ids or plan.tier_ops
                or (tiers is not None and tiers.has_outstanding)):
            return None, None
        with self.rank.tp.counting_errors():
            self._broadcast(plan)
        return execute_plan(self.rank, plan)

    def _broadcast(self, plan: StepPlan) -> None:
        broadcast_plan(plan, self.rank.tp.cpu_group)
        if self._keepalive is not None:
            self._keepalive.sent()

    def _send_keepalive(self) -> None:
        with self.rank.tp.counting_errors():
            broadcast_plan(StepPlan(), self.rank.tp.cpu_group)

    def _has_outstanding_transfers(self) -> bool:
        tiers = self.scheduler.kv.tiers
        return tiers is not None and tiers.has_outstanding

    def _maybe_snapshot(self, force: bool = False) -> None:
        """Every ``kv_snapshot_interval_s`` (and at shutdown) each rank saves its disk index."""
        tiers = self.scheduler.kv.tiers
        if tiers is None or tiers.disk is None:
            return
        if not force and time.monotonic() - self._last_snapshot < self.config.kv_snapshot_interval_s:
            return
        self._last_snapshot = time.monotonic()
        tiers.save_index()
        assert self._tier_config is not None and self._tier_config.disk_dir is not None
        save_token_index(self._tier_config.disk_dir, self._tier_config.identity, tiers)

    def _run_transfers_now(self, ops: Tuple[TierOp, ...]) -> Optional[TierOpResults]:
        """Every rank runs ``ops`` and waits for all its transfers; the agreed outcomes (the
        scheduler's hook: restores before the step that needs them)."""
        plan = StepPlan(tier_ops=ops, wait_transfers=True)
        with self.rank.tp.counting_errors():
            self._broadcast(plan)
        _, results = execute_plan(self.rank, plan)
        return results

    def _drain_transfers(self) -> None:
        """Run every queued transfer to completion and commit it (a plan with nothing to compute)."""
        tiers = self.scheduler.kv.tiers
        while tiers is not None and tiers.has_outstanding:
            plan = StepPlan(tier_ops=tiers.take_ops(), wait_transfers=True)
            with self.rank.tp.counting_errors():
                broadcast_plan(plan, self.rank.tp.cpu_group)
            _, results = execute_plan(self.rank, plan)
            if results is not None:
                tiers.commit(results)

    def _append(self, request: Request, token: SampledToken) -> RequestOutput:
        request.append_token(token)  # in place of its pending token
        reason = request.stop_reason_for_last_token()
        if request.grammar is not None:  # complete (STOP), or refused the token (ABORT)
            reason = self.structured.accept(request.grammar, token.token_id) or reason
        delta, stopped_by_string = "", False
        detok = self._detok.get(request.request_id)
        if detok is not None:
            # As vLLM: stop strings count once more than min_tokens tokens were generated.
            can_stop = len(request.output_token_ids) > request.params.min_tokens
            delta, stopped_by_string = detok.add_token(token.token_id, can_stop)
        if stopped_by_string:
            reason = FinishReason.STOP
        elif reason is None and request.num_known_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return self._output(request, [token.token_id], delta)
        self.scheduler.finish(request, reason)
        return self._output(request, [token.token_id], delta + self._flush(request))

    def _finish_output(self, request: Request) -> RequestOutput:
        return self._output(request, [], self._flush(request))

    def _flush(self, request: Request) -> str:
        """The text a finished request's detokenizer held back (for an incomplete character or
        a stop string that never came); empty after a stop string."""
        detok = self._detok.get(request.request_id)
        return detok.flush() if detok is not None else ""

    def _output(self, request: Request, new_ids: List[int], delta: str) -> RequestOutput:
        detok = self._detok.get(request.request_id)
        if request.is_finished:
            request.grammar = None
            self._detok.pop(request.request_id, None)
            choices = self._requests.get(request.parent_id, ())
            if all(r.is_finished for r in choices):
                self._requests.pop(request.parent_id, None)
        return request_output(request, new_ids, delta, detok.text if detok is not None else "")

    @property
    def async_scheduling(self) -> bool:
        """Whether steps run overlapped (`workers.step_sampling`); settable between requests."""
        return self._sampler.overlap

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if self.has_unfinished():
            raise RuntimeError("async_scheduling changes between requests, not while any runs")
        self._sampler.overlap = on

    @property
    def rank_device(self) -> torch.device:
        """The device rank 0 computes on."""
        return self._device

    @property
    def child_ranks(self):
        """The launcher's handles of ranks 1..N-1 (None at TP 1)."""
        return self._children

    def rank_reports(self) -> List[RankReport]:
        """Rank 0's report now, then the latest of each rank 1..N-1 that has one (a rank
        reports when its plan loop ends; see the launcher)."""
        children = self._children.reports() if self._children is not None else []
        return [rank_report(self.rank)] + children

    def collective_errors(self) -> Dict[str, int]:
        """Failed collectives of every rank, summed by kind (`parallel.collective_errors`)."""
        return sum_counts(report.collective_errors for report in self.rank_reports())

    def kv_usage(self) -> KVUsage:
        return self.scheduler.kv_usage()

    def kv_tier_stats(self) -> Dict[str, object]:
        """The tiers' numbers for the serving layer (`workers.tier_setup.tier_stats`); empty
        without tiers."""
        return tier_stats(self.scheduler.kv, self.rank.tiers, self._tier_config,
                          self.config.tp_size, self.config.block_size)

    def shutdown(self, failed: bool = False) -> None:
        """Stop the child ranks: a shutdown plan releases their blocked broadcast. ``failed``: a
        step raised, so the group's collectives are broken and a rank may be hung; no plan can
        reach the ranks, and they are killed at once rather than waited for."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if self._keepalive is not None:
            self._keepalive.close()  # from here on only this thread broadcasts
        try:
            if self._launched is not None and not failed:
                self._launched.copy.wait()  # its host buffers stay until the copy is done
            self._launched = None
            self._drain_transfers()
            self._maybe_snapshot(force=True)
            self._drain_transfers()
        finally:
            self._stop_ranks(failed)

    def _stop_ranks(self, failed: bool) -> None:
        if self._children is not None:
            told = False
            try:
                if not failed:
                    broadcast_plan(StepPlan(shutdown=True), self.rank.tp.cpu_group)
                    told = True
            finally:
                # A rank that missed the plan never stops by itself: waiting for it only holds
                # the group's devices from its replacement.
                self._children.join(RANK_STOP_S if told else 0.0)
                self.rank.tp.destroy()
        self.rank.close()
        if self._disk_lock is not None:
            self._disk_lock.release()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
