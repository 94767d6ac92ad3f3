"""One OpenAI request in flight at the ingress: the group's chunks in, a response or SSE out.

``GroupStream`` wraps the streaming handle call to a TP group (its `cluster.contract.GroupChunk`s)
and turns its failures into ``ProtocolError``s; ``RequestRun`` keeps what has been seen of each
of the request's ``n`` choices (text and token ids) and builds the JSON response (``collect``)
or the stream of server-sent events (``events``); the gRPC API reads its chunks (``updates``)
or waits for the end (``drain``). A chat request with tools (`cluster.api.tools.plan`) has each
choice's text parsed into content and tool calls, whole or as it streams (one parser per
choice). Nothing here knows Ray Serve beyond the handle's response object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentResponseGenerator

from cluster.api.admission import DEFAULT_RETRY_AFTER_S, overloaded
from cluster.api.metrics import RequestTimer
from cluster.api.tools.plan import ChoiceTools, ToolPlan
from cluster.contract import GroupChunk
from cluster.api.protocol import (
    SSE_DONE,
    ChoiceResult,
    CompletionFormat,
    ProtocolError,
    TokenLogprob,
    sse_event,
    token_logprobs,
    usage,
)
from workers.async_engine import EngineDeadError

logger = logging.getLogger(__name__)


def group_error(exc: BaseException) -> ProtocolError:
    """What a failure of the group call means to the client (never internals: those are
    logged). Ray wraps an exception raised in the replica in a ``RayTaskError`` that is also an
    instance of the original class."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(exc, ValueError):
        return ProtocolError(str(cause))
    if isinstance(exc, BackPressureError):  # the wait for a group slot is full
        return overloaded("every TP group is busy and the queue for them is full; retry after "
                          f"{exc.retry_after_s or DEFAULT_RETRY_AFTER_S:g} s",
                          exc.retry_after_s or DEFAULT_RETRY_AFTER_S)
    if isinstance(exc, DeploymentUnavailableError):
        return ProtocolError("no TP group can serve requests", 503, code="no_healthy_group",
                             retry_after_s=DEFAULT_RETRY_AFTER_S)
    if isinstance(exc, (EngineDeadError, RayActorError)):
        logger.warning("TP group failed while serving a request: %s", cause)
        return ProtocolError("the TP group serving this request failed; retry", 503,
                             code="group_failed", retry_after_s=DEFAULT_RETRY_AFTER_S)
    logger.error("group call failed", exc_info=exc)
    return ProtocolError("internal server error", 500)


def failure_reason(exc: BaseException) -> Optional[str]:
    """Why a group call failed, if the group failed (``engine_dead``: its engine stopped;
    ``actor_died``: its replica's process is gone); None for any other error."""
    if isinstance(exc, EngineDeadError):
        return "engine_dead"
    if isinstance(exc, RayActorError):
        return "actor_died"
    return None


@dataclass(frozen=True)
class MigrationPolicy:
    """How a request outlives its group (``max_migrations`` 0: it does not, the ingress sends
    it once). ``max_migrations``: re-sends after a group failed while it held the request; an attempt that fails before its first chunk (the group was
    already dead) is not one of them and is retried after a backoff that doubles from
    ``first_backoff_s`` up to ``max_backoff_s``, for at most ``max_wait_s`` in all (the router
    sends nothing to a group whose engine it knows dead, and waits for a replacement)."""

    max_migrations: int = 3
    first_backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    max_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")


Restart = Callable[[List[int]], DeploymentResponseGenerator]


class GroupStream:
    """One request's chunks from a TP group; ``cancel`` aborts it there (idempotent). It ends
    when all ``num_choices`` choices have finished.

    With ``restart`` (called with the tokens produced so far), a group failure does not end
    it: the request goes to another group, resumed after those tokens, and the chunks go on
    where they stopped (one uninterrupted stream; in fp32 greedy output equals the
    uninterrupted run's, in bf16 it may diverge after the cut). Requests of several choices
    move only before their first token."""

    def __init__(self, response: DeploymentResponseGenerator, num_choices: int = 1,
                 restart: Optional[Restart] = None, policy: MigrationPolicy = MigrationPolicy(),
                 on_migrate: Callable[[str], None] = lambda reason: None) -> None:
        self._response = response
        self._num_unfinished = num_choices
        self._num_choices = num_choices
        self._restart = restart
        self._policy = policy
        self._on_migrate = on_migrate
        self._tokens: List[int] = []  # produced so far (choice 0 of a one-choice request)
        self._attempt_has_chunks = False
        self.num_migrations = 0
        self.finished = False

    def __aiter__(self) -> "GroupStream":
        return self

    async def __anext__(self) -> GroupChunk:
        if self.finished:
            raise StopAsyncIteration
        waited_s, num_waits = 0.0, 0
        while True:
            try:
                chunk = await self._response.__anext__()
                break
            except StopAsyncIteration:
                self.finished = True
                raise ProtocolError("the TP group ended the stream before the request "
                                    "finished", 500) from None
            except Exception as exc:
                delay = self._retry_delay(exc, waited_s, num_waits)
                if delay is None:
                    self.finished = True
                    raise group_error(exc) from exc
                await asyncio.sleep(delay)
                waited_s, num_waits = waited_s + delay, num_waits + (delay > 0)
                self._response = self._restart(list(self._tokens))  # type: ignore[misc]
                self._attempt_has_chunks = False
        self._attempt_has_chunks = True
        if self._num_choices == 1:
            self._tokens.extend(chunk.new_token_ids)
        self._num_unfinished -= chunk.finished
        self.finished = self._num_unfinished == 0
        return chunk

    def _retry_delay(self, exc: BaseException, waited_s: float,
                     num_waits: int) -> Optional[float]:
        """Seconds to wait before sending the request again, or None to fail it."""
        reason = failure_reason(exc)
        if reason is None or self._restart is None:
            return None
        if self._num_choices > 1 and (self._tokens or self._attempt_has_chunks):
            return None  # several choices: no resume once they started
        policy = self._policy
        if self._attempt_has_chunks:  # the group failed while it held the request
            if self.num_migrations >= policy.max_migrations:
                return None
            self.num_migrations += 1
            self._on_migrate(reason)
            logger.warning("migrating a request after %d tokens: %s", len(self._tokens), exc)
            return 0.0
        if waited_s >= policy.max_wait_s:
            return None
        self._on_migrate(f"{reason}_before_start")
        return min(policy.max_backoff_s, policy.first_backoff_s * 2 ** num_waits)

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._response.cancel()


class MergedStreams:
    """The chunks of several streams (a batch's prompts) as one, in the order they come; a
    chunk of stream p has its choice ``index`` moved up by the choices of the streams before it
    (``num_choices`` each). A failure of one cancels the others."""

    def __init__(self, streams: List[Any], num_choices: int) -> None:
        self._streams = streams
        self._num_choices = num_choices
        self._next: Dict[int, "asyncio.Task[GroupChunk]"] = {}
        self._ready: List[GroupChunk] = []

    @property
    def finished(self) -> bool:
        """Every chunk read out. A stream turns finished as its last chunk is read, which may
        sit in a pending read (``_next``) until the next ``__anext__`` takes it."""
        return not self._ready and not self._next and all(s.finished for s in self._streams)

    def __aiter__(self) -> "MergedStreams":
        return self

    async def __anext__(self) -> GroupChunk:
        while not self._ready:
            for p, stream in enumerate(self._streams):
                if p not in self._next and not stream.finished:
                    self._next[p] = asyncio.ensure_future(stream.__anext__())
            if not self._next:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(self._next.values(), return_when=asyncio.FIRST_COMPLETED)
            for p, task in sorted(self._next.items()):
                if task in done:
                    del self._next[p]
                    self._take(p, task)
        return self._ready.pop(0)

    def _take(self, p: int, task: "asyncio.Task[GroupChunk]") -> None:
        try:
            chunk = task.result()
        except BaseException:
            self.cancel()
            raise
        if p:
            chunk = dataclasses.replace(chunk, index=chunk.index + p * self._num_choices)
        self._ready.append(chunk)

    def cancel(self) -> None:
        for task in self._next.values():
            task.cancel()
        self._next.clear()
        for stream in self._streams:
            stream.cancel()


@dataclass
class _Choice:
    texts: List[str] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    num_output_tokens: int = 0
    finish_reason: Optional[str] = None
    logprobs: List[TokenLogprob] = field(default_factory=list)
    tools: Optional[ChoiceTools] = None  # the request has tools to parse


@dataclass
class RequestRun:
    """A request in flight: where its chunks come from and what has been seen of them.

    ``echo`` is the text each choice starts with, by choice (its prompt, for ``echo``);
    ``on_end(run, outcome)`` is called once when the request ends (``outcome``: None, "error"
    or "abort")."""

    fmt: CompletionFormat
    stream: GroupStream
    timer: RequestTimer
    num_prompt_tokens: int
    num_choices: int
    want_logprobs: bool
    decode_token: Callable[[int], str]
    on_end: Callable[["RequestRun", Optional[str]], None]
    echo: List[str] = field(default_factory=list)  # empty: no echo
    continuous_usage: bool = False
    tools: Optional[ToolPlan] = None
    choices: List[_Choice] = field(default_factory=list)
    is_recorded: bool = False

    def __post_init__(self) -> None:
        self.choices = [_Choice(tools=self.tools.choice() if self.tools else None)
                        for _ in range(self.num_choices)]

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.choices[0].finish_reason

    def end(self, outcome: Optional[str]) -> None:
        """Once per request: abort it in the group if unfinished, and record it."""
        self.stream.cancel()
        if not self.is_recorded:
            self.is_recorded = True
            self.on_end(self, outcome)

    def _on_chunk(self, chunk: GroupChunk) -> _Choice:
        choice = self.choices[chunk.index]
        self.timer.on_tokens(len(chunk.new_token_ids))
        choice.num_output_tokens = chunk.num_output_tokens
        choice.texts.append(chunk.delta_text)
        if choice.tools is not None:
            choice.tools.add(chunk.delta_text, chunk.new_token_ids)
        choice.token_ids.extend(chunk.new_token_ids)
        if chunk.finished:
            choice.finish_reason = chunk.finish_reason
        if self.want_logprobs and chunk.logprobs:
            choice.logprobs.extend(token_logprobs(chunk.logprobs, self.decode_token))
        return choice

    async def updates(self) -> AsyncIterator[Tuple[GroupChunk, "_Choice"]]:
        """Each chunk with its choice, once counted. The request ends (aborted in the group if
        unfinished, and recorded) when the iteration does: done, failed, or closed early."""
        outcome = "abort"
        try:
            async for chunk in self.stream:
                yield chunk, self._on_chunk(chunk)
            outcome = None
        except ProtocolError:
            outcome = "error"
            raise
        finally:
            self.end(outcome)

    async def drain(self) -> None:
        """Waits until every choice finished (their texts and token ids are in ``choices``)."""
        async with aclosing(self.updates()) as updates:
            async for _ in updates:
                pass

    async def collect(self) -> Dict[str, Any]:
        """The whole response, once every choice finished."""
        await self.drain()
        results = [self._result(i, c) for i, c in enumerate(self.choices)]
        return self.fmt.response(results, self.num_prompt_tokens, self.num_output_tokens)

    def _result(self, index: int, choice: _Choice) -> ChoiceResult:
        logprobs = choice.logprobs if self.want_logprobs else None
        if choice.tools is None:
            return ChoiceResult(self._echo(index) + "".join(choice.texts), choice.finish_reason,
                                logprobs)
        parsed, reason = choice.tools.response(choice.finish_reason)
        return ChoiceResult(parsed.content, reason, logprobs, parsed.calls)

    async def first_chunk(self) -> GroupChunk:
        """Waits for the first chunk, so an error before it still gets its HTTP status."""
        try:
            return await self.stream.__anext__()
        except BaseException as exc:
            self.end("error" if isinstance(exc, Exception) else "abort")
            raise

    async def events(self, first: GroupChunk) -> AsyncIterator[str]:
        """The SSE stream. Starlette closes it when the client disconnects (and Serve cancels
        the replica's task): ``finally`` then cancels the group call."""
        outcome = "abort"
        try:
            for obj in self.fmt.start(self.num_choices):
                yield sse_event(obj)
            for index in range(self.num_choices) if self.echo else ():
                yield sse_event(self.fmt.delta(self._echo(index), None, index,
                                               self._usage_now()))
            chunk: Optional[GroupChunk] = first
            while chunk is not None:
                for event in self._chunk_events(chunk):
                    yield event
                chunk = None if self.stream.finished else await self.stream.__anext__()
            if self.fmt.include_usage:
                yield sse_event(self.fmt.usage_chunk(self.num_prompt_tokens,
                                                     self.num_output_tokens))
            outcome = None
            yield SSE_DONE
        except ProtocolError as exc:  # the group failed mid-stream: say so in the stream
            outcome = "error"
            yield sse_event(exc.body())
            yield SSE_DONE
        finally:
            self.end(outcome)

    def _chunk_events(self, chunk: GroupChunk) -> List[str]:
        index = chunk.index
        choice = self._on_chunk(chunk)
        num_new = len(chunk.logprobs) if self.want_logprobs else 0
        new_logprobs = choice.logprobs[len(choice.logprobs) - num_new:] if num_new else None
        if choice.tools is not None:
            return self._tool_events(chunk, choice, new_logprobs)
        events = []
        if chunk.delta_text or new_logprobs:
            events.append(sse_event(self.fmt.delta(chunk.delta_text, new_logprobs, index,
                                                   self._usage_now())))
        if chunk.finished:
            events.append(sse_event(self.fmt.finish(choice.finish_reason, index,
                                                    self._usage_now())))
        return events

    def _tool_events(self, chunk: GroupChunk, choice: _Choice,
                     new_logprobs: Optional[List[TokenLogprob]]) -> List[str]:
        """A chunk of a choice whose text is parsed: its content and its tool-call parts."""
        assert choice.tools is not None
        index = chunk.index
        parsed, reason = choice.tools.streamed(chunk.finished, choice.finish_reason)
        events = []
        if parsed.content or new_logprobs:
            events.append(sse_event(self.fmt.delta(parsed.content, new_logprobs, index,
                                                   self._usage_now())))
        if parsed.calls:
            events.append(sse_event(self.fmt.tool_delta(  # type: ignore[attr-defined]
                parsed.calls, index, self._usage_now())))
        if chunk.finished:
            events.append(sse_event(self.fmt.finish(reason, index, self._usage_now())))
        return events

    def _echo(self, index: int) -> str:
        return self.echo[index] if self.echo else ""

    def _usage_now(self) -> Optional[Dict[str, int]]:
        if not self.continuous_usage:
            return None
        return usage(self.num_prompt_tokens, self.num_output_tokens)
