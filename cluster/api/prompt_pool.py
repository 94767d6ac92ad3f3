"""The ingress's prompt work (chat templates, tokenizing, detokenizing) off its event loop.

A chat template is a Jinja program: a hundred bytes of nested loops render for minutes, and
tokenizing a body of several MiB takes a while too. On the event loop either would stall every
other request of the replica, ``/health`` and the gRPC API included. So each request's prompt
work is one job on a small thread pool, and each job is bounded in time from when it starts:
past ``prompt_timeout_s`` an exception is raised in the job's thread (CPython's asynchronous
exception), which stops a template at its next bytecode, frees the thread, and answers the
request with a 400 naming the bound. A job inside one long C call (the tokenizer's) stops when
that call returns; the body size limit bounds those.

A chat template sent in a request is checked (``check_chat_templates``: trusted or refused,
size) before any of it runs. A request's output constraint is checked the same way
(``check_constraint``: its xgrammar grammar built, bounded in time), xgrammar imported on the
pool the first time (outside the bound: the import takes seconds once).
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, TypeVar

from cluster.api.prompts import PromptCodec
from cluster.api.protocol import ProtocolError
from cluster.api.request_limits import IngressLimits, check_chat_templates
from cluster.api.structured_requests import Constraint
from workers.structured import syntax

T = TypeVar("T")

NUM_PROMPT_THREADS = 4  # jobs run at once per replica; the rest wait for a thread


class _Overdue(BaseException):
    """Raised in a job's thread past its bound. Not an ``Exception``, so the ``except
    Exception`` of template and tokenizer code (and of ``PromptCodec``) lets it through."""


def _raise_in_thread(thread_id: int, exc_type: type) -> None:
    """``exc_type`` is raised in the thread ``thread_id`` at its next bytecode."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type))


class _Job:
    """One piece of work on a pool thread, interrupted ``timeout_s`` after it starts. The
    exception is raised only while the work runs (under ``_lock``), never in the pool's code."""

    def __init__(self, work: Callable[[], T], loop: asyncio.AbstractEventLoop,
                 timeout_s: float) -> None:
        self._work = work
        self._loop = loop
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._thread_id: Optional[int] = None  # while the work runs
        self._timer: Optional[asyncio.TimerHandle] = None

    def run(self) -> T:
        """In a pool thread."""
        with self._lock:
            self._thread_id = threading.get_ident()
        self._loop.call_soon_threadsafe(self._arm)
        try:
            return self._work()
        finally:
            with self._lock:
                self._thread_id = None
            self._loop.call_soon_threadsafe(self._disarm)

    def _arm(self) -> None:
        self._timer = self._loop.call_later(self._timeout_s, self._interrupt)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _interrupt(self) -> None:
        with self._lock:
            if self._thread_id is not None:
                _raise_in_thread(self._thread_id, _Overdue)


class PromptPool:
    """``PromptCodec``'s work for the ingress, awaited on its event loop, run on a pool of
    ``NUM_PROMPT_THREADS`` threads, each job bounded by ``limits.prompt_timeout_s``."""

    def __init__(self, codec: PromptCodec, limits: IngressLimits,
                 num_threads: int = NUM_PROMPT_THREADS) -> None:
        self.codec = codec
        self._limits = limits
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tpserve-prompts")

    async def prompt_ids(self, prompts: Sequence[Any], add_special_tokens: Optional[bool]
                         ) -> List[List[int]]:
        """Each completion prompt's token ids (``PromptCodec.prompt_ids``)."""
        return await self.run(lambda: [self.codec.prompt_ids(p, add_special_tokens)
                                        for p in prompts], "prompt")

    async def chat_prompt_ids(self, body: Any) -> List[int]:
        """A chat request's (or a chat ``/tokenize``'s) ``messages`` through its chat
        template: the model's, or (trusted, within the size limit) the request's own."""
        sent = body.request_templates()
        check_chat_templates(sent, self._limits)
        return await self.run(lambda: self.codec.chat_prompt_ids(
            body.messages, body.template_options(), body.add_special_tokens),
            sent[0][0] if sent else "messages")

    async def texts(self, token_ids: Sequence[Sequence[int]]) -> List[str]:
        """Each token id list as text (``PromptCodec.detokenize``)."""
        return await self.run(lambda: [self.codec.detokenize(ids) for ids in token_ids],
                              "prompt")

    async def check_constraint(self, constraint: Optional[Constraint]) -> None:
        """A 400 naming the constraint's field if its schema, regex or grammar is malformed
        (`workers.structured.syntax.check_syntax`) or takes past the bound to check."""
        if constraint is None:
            return
        await asyncio.wrap_future(self._pool.submit(syntax.load))
        try:
            await self.run(lambda: syntax.check_syntax(constraint.output), constraint.param,
                           "checking the output constraint")
        except ValueError as exc:
            raise ProtocolError(f"{constraint.param}: {exc}", param=constraint.param) from None

    async def run(self, work: Callable[[], T], param: str,
                  what: str = "rendering and tokenizing the prompt") -> T:
        """``work()`` on a pool thread; a 400 naming ``param`` and the bound if it runs past
        it. (Not 408 or 504, which OpenAI's clients retry: the same input takes as long.)"""
        timeout_s = self._limits.prompt_timeout_s
        job = _Job(work, asyncio.get_running_loop(), timeout_s)
        try:
            return await asyncio.wrap_future(self._pool.submit(job.run))
        except _Overdue:
            raise ProtocolError(f"{param}: {what} took longer than this server's bound of "
                                f"{timeout_s:g} s and was stopped",
                                param=param, code="prompt_timeout") from None
