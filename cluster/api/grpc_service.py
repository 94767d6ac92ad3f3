"""The ``tpserve.v1.TPServe`` gRPC service, run by the OpenAI ingress deployment.

Serve's gRPC proxy deserializes a call's request and invokes the ingress deployment's method named
after the RPC (``Complete``, ``CompleteStream``, ...) with it and a ``grpc_context``
(``ray.serve.grpc_util.RayServegRPCContext``: the call's metadata in, status code and details
out). Those methods hand over to ``GrpcService``, which takes the HTTP API's path: the API key
from the ``authorization`` metadata, the proto request converted to the HTTP API's request
(``cluster.api.grpc_protocol``), then one of the ingress's generation slots (``admit``) and its
``completion_run`` / ``chat_run`` (tokenizer, chat template, token budget, the request timeout,
the group call through the KV-aware router, migration) and ``RequestRun``'s chunks, recorded in
the same metrics.

Errors: a ``ProtocolError`` becomes its gRPC status code with the HTTP API's message; anything
else is logged and answered ``INTERNAL`` "internal server error". A unary call sets the code on
the context and returns an empty message (the proxy copies the context to the call). A stream
has no message to carry a late status, so it sets the code and raises: Serve's proxy then
answers with the code and details set. A client that cancels (or whose deadline passes) makes
the proxy cancel the replica's task; the run's iteration closes and aborts the group's request.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Optional, Protocol, TypeVar

import grpc

from cluster.api.grpc_protocol import (
    SERVICER_FUNCTION,
    chat_request,
    completion_request,
    completion_response,
    status_code,
    tool_call_deltas,
    usage,
)
from cluster.api.request_run import RequestRun
from cluster.api.metrics import RequestTimer
from cluster.api.protocol import ProtocolError
from cluster.proto.tpserve.v1 import tpserve_pb2 as pb

B = TypeVar("B")


class IngressPath(Protocol):
    """What the service needs of the OpenAI ingress (`cluster.api.ingress.OpenAIIngress`): its
    checks, its generation slots and the runs of its request path."""

    served_model_name: str
    metrics: Any
    request_timeout_s: float

    def authorize(self, authorization: Optional[str]) -> None: ...

    def check_body(self, body: B) -> B: ...

    def admit(self) -> Callable[[], None]: ...

    def completion_run(self, body: Any, timer: RequestTimer, *, timeout_s: float,
                       release: Callable[[], None]) -> RequestRun: ...

    def chat_run(self, body: Any, timer: RequestTimer, *, timeout_s: float,
                 release: Callable[[], None]) -> RequestRun: ...

logger = logging.getLogger(__name__)


def _metadata(context: Any, key: str) -> str:
    for name, value in context.invocation_metadata():
        if name == key:
            return value
    return ""


async def _response(run: RequestRun) -> pb.CompletionResponse:
    try:
        await run.drain()
    finally:
        run.end("abort")  # a no-op once the run ended; else it frees the group and the slot
    choice = run.choices[0]
    if choice.tools is not None:  # a chat with tools: its calls parsed out of the text
        parsed, reason = choice.tools.response(choice.finish_reason)
        return completion_response(run.fmt.request_id, parsed.content, choice.token_ids, reason,
                                   run.num_prompt_tokens, run.num_output_tokens, parsed.calls)
    return completion_response(run.fmt.request_id, "".join(choice.texts), choice.token_ids,
                               choice.finish_reason, run.num_prompt_tokens,
                               run.num_output_tokens)


async def _chunks(run: RequestRun) -> AsyncIterator[pb.CompletionChunk]:
    async with aclosing(run.updates()) as updates:
        async for chunk, choice in updates:
            message = pb.CompletionChunk(id=run.fmt.request_id, text=chunk.delta_text,
                                         token_ids=chunk.new_token_ids)
            reason = choice.finish_reason
            if choice.tools is not None:  # a chat with tools: content and parts of calls
                parsed, reason = choice.tools.streamed(chunk.finished, reason)
                message.text = parsed.content
                message.tool_calls.extend(tool_call_deltas(parsed.calls))
            if chunk.finished:
                message.finish_reason = reason or ""
                message.usage.CopyFrom(usage(run.num_prompt_tokens, run.num_output_tokens))
            yield message


class GrpcService:
    """The RPCs of ``tpserve.v1.TPServe`` over an ingress's request path."""

    def __init__(self, ingress: IngressPath) -> None:
        self._ingress = ingress

    async def complete(self, request: pb.CompletionRequest, context: Any
                       ) -> pb.CompletionResponse:
        async def response() -> pb.CompletionResponse:
            return await _response(await self._completion_run(request, context))

        return await self._unary("Complete", context, pb.CompletionResponse, response)

    async def chat(self, request: pb.ChatRequest, context: Any) -> pb.CompletionResponse:
        async def response() -> pb.CompletionResponse:
            return await _response(await self._chat_run(request, context))

        return await self._unary("Chat", context, pb.CompletionResponse, response)

    def complete_stream(self, request: pb.CompletionRequest, context: Any
                        ) -> AsyncIterator[pb.CompletionChunk]:
        return self._stream("CompleteStream", context,
                            lambda: self._completion_run(request, context))

    def chat_stream(self, request: pb.ChatRequest, context: Any
                    ) -> AsyncIterator[pb.CompletionChunk]:
        return self._stream("ChatStream", context, lambda: self._chat_run(request, context))

    async def list_models(self, request: pb.ListModelsRequest, context: Any
                          ) -> pb.ListModelsResponse:
        async def models() -> pb.ListModelsResponse:
            self._ingress.authorize(_metadata(context, "authorization"))
            return pb.ListModelsResponse(models=[self._ingress.served_model_name])

        return await self._unary("ListModels", context, pb.ListModelsResponse, models)

    # ----- the shared path -----

    async def _completion_run(self, request: pb.CompletionRequest, context: Any
                              ) -> RequestRun:
        timer = RequestTimer()
        self._ingress.authorize(_metadata(context, "authorization"))
        body = self._ingress.check_body(completion_request(request))
        return await self._admitted(self._ingress.completion_run, body, timer)

    async def _chat_run(self, request: pb.ChatRequest, context: Any) -> RequestRun:
        timer = RequestTimer()
        self._ingress.authorize(_metadata(context, "authorization"))
        body = self._ingress.check_body(chat_request(request))
        return await self._admitted(self._ingress.chat_run, body, timer)

    async def _admitted(self, run: Callable[..., Awaitable[RequestRun]], body: Any,
                        timer: RequestTimer) -> RequestRun:
        """The run in one of the ingress's generation slots (429: RESOURCE_EXHAUSTED), within
        the server's request timeout (a client's deadline cancels the call sooner)."""
        release = self._ingress.admit()
        try:
            return await run(body, timer, timeout_s=self._ingress.request_timeout_s,
                             release=release)
        except BaseException:
            release()
            raise

    # ----- statuses -----

    async def _unary(self, method: str, context: Any, empty: Callable[[], Any],
                     call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            response = await call()
        except asyncio.CancelledError:
            self._record(method, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            self._fail(method, context, exc)
            return empty()
        self._record(method, grpc.StatusCode.OK)
        return response

    async def _stream(self, method: str, context: Any,
                      start: Callable[[], Awaitable[RequestRun]]
                      ) -> AsyncIterator[pb.CompletionChunk]:
        try:
            run = await start()
            try:
                async with aclosing(_chunks(run)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            finally:
                run.end("abort")  # a no-op once the run ended (as _response)
        except (asyncio.CancelledError, GeneratorExit):
            self._record(method, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            raise self._fail(method, context, exc) from None
        self._record(method, grpc.StatusCode.OK)

    def _fail(self, method: str, context: Any, exc: Exception) -> ProtocolError:
        """Set the status for ``exc`` on the call; the error to raise where one must be."""
        error = exc if isinstance(exc, ProtocolError) else None
        if error is None:
            logger.error("gRPC %s failed", method, exc_info=exc)
            error = ProtocolError("internal server error", 500)
        code = status_code(error)
        context.set_code(code)
        context.set_details(error.message)
        self._record(method, code)
        return error

    def _record(self, method: str, code: grpc.StatusCode) -> None:
        self._ingress.metrics.record_grpc(method, code.name)


def grpc_options(port: int) -> Optional[Dict[str, Any]]:
    """Serve's gRPC proxy options (``ray.serve.config.gRPCOptions`` fields) that serve
    ``tpserve.v1.TPServe`` on ``port`` (Serve binds every interface); None when ``port`` is 0
    (no gRPC). Given to ``serve.start``; a Serve config file's ``grpc_options`` hold the same."""
    if port == 0:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"--grpc-port must be a TCP port (1-65535) or 0 for none, got {port}")
    return {"port": port, "grpc_servicer_functions": [SERVICER_FUNCTION]}
