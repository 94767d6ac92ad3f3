"""The engine on a background thread, streaming to asyncio callers (the serving replica).

One thread owns the ``LLMEngine`` and steps it while there is work; callers on an event loop
submit requests and receive each request's outputs through an ``asyncio.Queue``. Adding and
aborting go through a command queue, so the engine is only ever touched by its thread. If a step
fails (a rank died, a collective timed out) every request in flight gets the error and the engine
reports itself dead, so its host can replace it; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from kv.kv_manager import KVUsage
from parallel.collective_errors import HANG
from workers.engine import LLMEngine, RequestOutput
from workers.sampling_params import SamplingParams
from workers.step_watchdog import StepHungError, StepWatchdog
from workers.structured.decoding import check_structured
from workers.waiting_demand import WaitingDemand

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # the engine thread's longest wait for a command between steps
_COMPILE_THREADS = 2  # grammars of served requests compile here, never on the engine thread

Prompt = Union[str, Sequence[int]]


class EngineDeadError(RuntimeError):
    """The engine stopped (a rank failed or it was shut down); its requests cannot finish."""


@dataclass(frozen=True)
class EngineLoad:
    """What the engine reports to the router, refreshed after every step."""

    seq: int
    time: float
    kv: KVUsage
    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # tokens to compute without a block yet (WaitingDemand + queued)
    cached_block_hashes: Tuple[int, ...]  # the pool's, most recently used first; then the host's
    accepted_ids: Tuple[str, ...] = ()  # routing ids accepted lately, all counted above


_Command = Tuple[str, tuple, Optional[Future]]


class AsyncLLMEngine:
    """``load`` is what the router reads: every request ``generate`` has accepted is in it, in
    the scheduler's counts or, still queued for the engine thread, in ``num_waiting_tokens``,
    and its ``routing_id`` is listed in ``accepted_ids`` for ``accepted_window_s`` (at most
    ``max_accepted_ids``), so a router knows which of its charges a report already holds."""

    def __init__(self, engine_factory: Callable[[], LLMEngine], max_cached_hashes: int = 4096,
                 accepted_window_s: float = 5.0, max_accepted_ids: int = 4096,
                 hung_after_s: Optional[float] = None) -> None:
        """Builds the engine on the calling thread (so load errors raise here), then starts.
        ``hung_after_s``: the watchdog's floor for declaring a step hung (default: the
        engine's step timeout, which also bounds every collective)."""
        self.engine = engine_factory()
        self._max_cached_hashes = max_cached_hashes
        self._accepted_window_s = accepted_window_s
        # Requests accepted but not yet applied by the engine thread, and recent routing ids;
        # the lock makes a snapshot see a request either queued or in the scheduler.
        self._ledger_lock = threading.Lock()
        self._queued_tokens = 0
        self._accepted: Deque[Tuple[float, str]] = collections.deque(maxlen=max_accepted_ids)
        self._commands: "queue.Queue[_Command]" = queue.Queue()
        self._streams: Dict[str, Tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._load_seq = 0
        self._waiting_demand = WaitingDemand()
        self._compile_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.load = self._snapshot_load()
        self._watchdog = StepWatchdog(hung_after_s or self.engine.config.step_timeout_s,
                                      self._on_hung)
        self._thread = threading.Thread(target=self._run, name="tpserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       routing_id: Optional[str] = None,
                       resume_output_ids: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (of all its ``n`` choices, each tagged with its
        ``index``); cancelling the iteration aborts the request. ``routing_id``: the id the
        router charged the request under (listed in ``load.accepted_ids``);
        ``resume_output_ids``: see ``LLMEngine.add_request`` (a migrated request)."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self._error}")
        grammar = await self._compile(params)  # raises ValueError: the caller's error
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        added: Future = Future()
        num_tokens = (0 if isinstance(prompt, str) else len(prompt)) + len(resume_output_ids)
        with self._ledger_lock:
            self._queued_tokens += num_tokens
            if routing_id:
                self._accepted.append((time.monotonic(), routing_id))
            self._commands.put(("add", (prompt, params, request_id, num_tokens,
                                        tuple(resume_output_ids), grammar), added))
        num_unfinished = params.n  # the stream ends when every choice has finished
        held: Deque[Union[RequestOutput, BaseException]] = collections.deque()
        try:
            await asyncio.wrap_future(added)  # raises ValueError on bad input
            while num_unfinished:
                item = held.popleft() if held else await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                item = _merge_queued(item, outputs, held)
                num_unfinished -= item.finished
                yield item
        finally:
            if self._streams.pop(request_id, None) is not None and self.is_alive:
                self._commands.put(("abort", (request_id,), None))

    async def _compile(self, params: SamplingParams):
        """``params.structured`` compiled on the compile pool (None without one), within the
        engine's ``grammar_compile_timeout_s``; ``ValueError`` past it or when it fails. A
        compile that runs past the limit finishes in the background and is cached."""
        if params.structured is None:
            return None
        check_structured(params)  # refused before it costs a compile
        if self._compile_pool is None:
            self._compile_pool = concurrent.futures.ThreadPoolExecutor(
                _COMPILE_THREADS, thread_name_prefix="tpserve-grammar")
        limit_s = self.engine.config.grammar_compile_timeout_s
        compiling = asyncio.get_running_loop().run_in_executor(
            self._compile_pool, self.engine.structured.compile, params.structured)
        try:
            return await asyncio.wait_for(compiling, limit_s)
        except asyncio.TimeoutError:
            raise ValueError(f"the {params.structured.kind.value} took longer than {limit_s:g} "
                             f"s to compile; simplify it") from None

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", (request_id,), None))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        self._watchdog.close()
        self._commands.put(("stop", (), None))
        self._thread.join(timeout_s)
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.engine.shutdown(failed=self._error is not None)
        except Exception as exc:  # noqa: BLE001 - a failed group cannot stop its ranks cleanly
            if self._error is None:
                raise
            logger.warning("engine stopped after its failure (%s): %s", self._error, exc)

    # ----- the engine thread -----

    def _run(self) -> None:
        try:
            while not self._stopping and self._error is None:
                self._drain_commands(self._idle_s())
                if self.engine.has_unfinished():
                    with self._watchdog.step():
                        outputs = self.engine.step()
                    self._deliver(outputs)
                # Refreshed when idle too (every drain timeout): a report that stops changing
                # looks stale to the router, which would then starve an idle group.
                self.load = self._snapshot_load()
        except Exception as exc:  # a rank or a collective failed: fail everything in flight
            logger.exception("engine step failed; failing %d requests", len(self._streams))
            self._error = exc
            self._fail_all(EngineDeadError(f"engine failed: {exc}"))

    def _on_hung(self, error: StepHungError) -> None:
        """From the watchdog's thread: the engine thread is stuck in a step; fail its requests
        now (they migrate) and report the engine dead (the group gets replaced). Counted as a
        failed collective of rank 0 (``hang``)."""
        self.engine.rank.tp.collective_errors.count(HANG)
        self._error = error
        self._fail_all(EngineDeadError(f"engine failed: {error}"))

    def _idle_s(self) -> float:
        """How long the engine thread may wait for a command before its next step: 0.5 s with
        nothing to do, until the spill bound pays with only held-back spills left, else 0."""
        if not self.engine.has_unfinished():
            return _IDLE_WAIT_S
        return min(_IDLE_WAIT_S, self.engine.idle_wait_s())

    def _drain_commands(self, wait_s: float) -> None:
        """Apply every queued command, first waiting up to ``wait_s`` for one."""
        try:
            command = (self._commands.get(timeout=wait_s) if wait_s > 0
                       else self._commands.get_nowait())
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, name: str, args: tuple, done: Optional[Future]) -> None:
        if name == "add":
            try:
                self.engine.add_request(args[0], args[1], request_id=args[2],
                                        resume_output_ids=args[4], grammar=args[5])
            except ValueError as exc:
                self._dequeued(args[3])
                done.set_exception(exc)
                self._streams.pop(args[2], None)
                return
            self._dequeued(args[3])
            done.set_result(None)
        elif name == "abort":
            self.engine.abort(args[0])

    def _deliver(self, outputs: List[RequestOutput]) -> None:
        """A step's outputs to their streams: one wake-up per event loop per step, carrying
        all of that loop's outputs (a wake-up per output would make the loop's thread contend
        for the GIL with this one once per request and step)."""
        by_loop: Dict[asyncio.AbstractEventLoop, List[Tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                loop, q = stream
                by_loop.setdefault(loop, []).append((q, out))
        for loop, handed in by_loop.items():
            loop.call_soon_threadsafe(_put_all, handed)

    def _fail_all(self, error: BaseException) -> None:
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, error)
        while True:
            try:
                _, _, done = self._commands.get_nowait()
            except queue.Empty:
                return
            if done is not None and not done.done():
                done.set_exception(error)

    def _dequeued(self, num_tokens: int) -> None:
        """The engine thread took a queued request (into the scheduler, or refused it)."""
        with self._ledger_lock:
            self._queued_tokens -= num_tokens

    def _snapshot_load(self) -> EngineLoad:
        sched = self.engine.scheduler
        self._load_seq += 1
        with self._ledger_lock:  # the engine thread applies no command meanwhile: it is here
            queued_tokens = self._queued_tokens
            horizon = time.monotonic() - self._accepted_window_s
            while self._accepted and self._accepted[0][0] < horizon:
                self._accepted.popleft()
            accepted_ids = tuple(routing_id for _, routing_id in self._accepted)
        return EngineLoad(
            seq=self._load_seq, time=time.time(), kv=sched.kv_usage(),
            # A request loading its prefix from host or disk holds blocks and runs next: running.
            num_running=len(sched.running) + len(sched.loading), num_waiting=len(sched.waiting),
            num_waiting_tokens=queued_tokens + self._waiting_demand.uncomputed_tokens(sched),
            cached_block_hashes=tuple(sched.kv.cached_hashes(self._max_cached_hashes)),
            accepted_ids=accepted_ids,
        )


def _put_all(handed: List[Tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in handed:
        q.put_nowait(out)


def _merge_queued(first: RequestOutput, outputs: asyncio.Queue,
                  held: Deque[Union[RequestOutput, BaseException]]) -> RequestOutput:
    """``first`` and the outputs of the same choice queued right behind it, as one (a stream
    read less often than the engine steps gets one output per read, not one per step); the
    first item that cannot join (another choice, an error) is put in ``held``."""
    while not first.finished and not outputs.empty():
        later = outputs.get_nowait()
        if isinstance(later, BaseException) or later.index != first.index:
            held.append(later)
            break
        first = merge_outputs(first, later)
    return first


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one choice as the one output a single step producing both
    steps' tokens would have given: the cumulative fields are ``later``'s, the new tokens and
    text both's."""
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               delta_text=earlier.delta_text + later.delta_text)
