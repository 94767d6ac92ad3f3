"""The OpenAI-compatible HTTP ingress: a FastAPI app served by a Ray Serve deployment.

Each request is authorized, parsed, tokenized (the checkpoint's tokenizer and chat template) and
checked against the context length here, so bad input gets a 4xx before anything is routed and
the router knows the request's token count. It then goes to a TP group through the group
deployment's handle, ``generate(payload, num_tokens=T, block_hashes=H)``, whose chunks
(``cluster.group_stream``) are turned into one OpenAI response or a stream of server-sent events
ending in ``data: [DONE]``. A client that goes away cancels its handle call, which aborts the
request in the engine. Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``.
"""

# No ``from __future__ import annotations`` here: Serve re-creates the route functions for the
# class-based view, and FastAPI must see the real ``Request`` annotation, not a string.
import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException

from cluster.group_stream import sampling_params
from cluster.metrics import (
    GroupRecord,
    IngressMetrics,
    RequestTimer,
    get_metrics_store,
    router_decision_counts,
)
from cluster.openai_protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatFormat,
    ChatMessage,
    CompletionFormat,
    CompletionRequest,
    ProtocolError,
    TokenLogprob,
    error_body,
    models_list,
    parse_request,
    resolve_max_tokens,
    sse_event,
    token_logprobs,
)
from kv.prefix_hash import extend_block_hashes
from workers.async_engine import EngineDeadError
from workers.model_config import load_model_config
from workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
METRICS_STORE_TIMEOUT_S = 2.0

app = FastAPI(title="tpserve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(ProtocolError)
async def _protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                   code=code), status_code=exc.status_code)


def group_error(exc: BaseException) -> ProtocolError:
    """What a failure of the group call means to the client. Ray wraps an exception raised in
    the replica in a ``RayTaskError`` that is also an instance of the original class."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(exc, ValueError):
        return ProtocolError(str(cause))
    if isinstance(exc, BackPressureError):
        return ProtocolError(f"the server is overloaded, retry later: {cause}", 503,
                             code="overloaded")
    if isinstance(exc, (EngineDeadError, RayActorError)):
        return ProtocolError(f"the TP group serving this request failed: {cause}", 503,
                             code="group_failed")
    logger.error("group call failed", exc_info=exc)
    return ProtocolError(f"internal error: {type(cause).__name__}: {cause}", 500)


class GroupStream:
    """One request's chunks from a TP group; ``cancel`` aborts it there (idempotent)."""

    def __init__(self, response: DeploymentResponseGenerator) -> None:
        self._response = response
        self.finished = False

    def __aiter__(self) -> "GroupStream":
        return self

    async def __anext__(self) -> Dict[str, Any]:
        if self.finished:
            raise StopAsyncIteration
        try:
            chunk = await self._response.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise ProtocolError("the TP group ended the stream before the request finished",
                                500) from None
        except Exception as exc:
            self.finished = True
            raise group_error(exc) from exc
        self.finished = bool(chunk["finished"])
        return chunk

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._response.cancel()


@dataclass
class _Run:
    """A request in flight: where its chunks come from and what has been seen of them."""

    fmt: CompletionFormat
    stream: GroupStream
    timer: RequestTimer
    num_prompt_tokens: int
    want_logprobs: bool
    num_output_tokens: int = 0
    finish_reason: Optional[str] = None
    is_recorded: bool = False
    logprobs: List[TokenLogprob] = field(default_factory=list)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, group_handle: DeploymentHandle, model_dir: str, served_model_name: str,
                 block_size: int, max_model_len: int, api_key: Optional[str] = None) -> None:
        if block_size < 1 or max_model_len < 2:
            raise ValueError(f"block_size must be >= 1 and max_model_len >= 2, got "
                             f"{block_size} and {max_model_len}")
        self._group = group_handle.options(stream=True)
        self.model_dir = str(model_dir)
        self.served_model_name = served_model_name
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._api_key = api_key or None
        self.tokenizer = load_tokenizer(Path(model_dir))
        self.vocab_size = load_model_config(Path(model_dir)).vocab_size
        self.metrics = IngressMetrics(served_model_name, max_model_len, export_to_ray=True)
        self._store = get_metrics_store()
        self._created = int(time.time())

    # ----- endpoints -----

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        timer = RequestTimer()
        self._authorize(request)
        body = parse_request(await request.body(), CompletionRequest)
        self._check_model(body.model)
        prompt_ids = self._prompt_ids(body.prompt)
        max_tokens = resolve_max_tokens(body.max_tokens, len(prompt_ids), self.max_model_len,
                                        default=DEFAULT_COMPLETION_MAX_TOKENS)
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()),
                               self.served_model_name, body.include_usage)
        return await self._serve(fmt, body.sampling(max_tokens), body.stream, prompt_ids,
                                 timer)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        timer = RequestTimer()
        self._authorize(request)
        body = parse_request(await request.body(), ChatCompletionRequest)
        self._check_model(body.model)
        prompt_ids = self._chat_prompt_ids(body.messages)
        max_tokens = resolve_max_tokens(body.requested_max_tokens, len(prompt_ids),
                                        self.max_model_len, param=body.max_tokens_param,
                                        prompt_param="messages")
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()),
                         self.served_model_name, body.include_usage)
        return await self._serve(fmt, body.sampling(max_tokens), body.stream, prompt_ids,
                                 timer)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Dict[str, Any]:
        self._authorize(request)
        return models_list(self.served_model_name, self.model_dir, self.max_model_len,
                           self._created)

    @app.get("/health")
    async def health(self) -> Dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text(self) -> Response:
        groups = await self._group_records()
        return Response(self.metrics.render(groups, router_decision_counts()),
                        media_type=CONTENT_TYPE_LATEST)

    # ----- checks -----

    def _authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ProtocolError("missing API key: send 'Authorization: Bearer <key>'", 401,
                                code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            raise ProtocolError("incorrect API key provided", 401, code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model not in (self.served_model_name, self.model_dir):
            raise ProtocolError(f"the model '{model}' does not exist; this server serves "
                                f"'{self.served_model_name}'", 404, param="model",
                                code="model_not_found")

    def _prompt_ids(self, prompt: Any) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ProtocolError("this model has no tokenizer: send the prompt as token ids",
                                    param="prompt")
            prompt = self.tokenizer.encode(prompt)
            if not prompt:
                raise ProtocolError("the prompt tokenizes to no tokens", param="prompt")
            return list(prompt)
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            raise ProtocolError(f"prompt token ids must be in [0, {self.vocab_size}); got "
                                f"{bad[:5]}", param="prompt")
        return list(prompt)

    def _chat_prompt_ids(self, messages: Sequence[ChatMessage]) -> List[int]:
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so no chat template: use "
                                "/v1/completions with token ids", param="messages")
        conversation = [m.template_message() for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                     tokenize=True)
        except Exception as exc:  # jinja errors (e.g. roles must alternate), no template
            raise ProtocolError(f"cannot apply the chat template: {exc}", param="messages")
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def _check_sampling(sampling: Dict[str, Any]) -> None:
        try:
            sampling_params(sampling)
        except ValueError as exc:
            message = str(exc)
            first_word = message.split(" ", 1)[0]
            raise ProtocolError(message, param=first_word if first_word in sampling else None)

    # ----- running a request -----

    async def _serve(self, fmt: CompletionFormat, sampling: Dict[str, Any], stream: bool,
                     prompt_ids: List[int], timer: RequestTimer) -> Response:
        self._check_sampling(sampling)
        payload = {"request_id": fmt.request_id, "prompt_token_ids": prompt_ids,
                   "sampling": sampling}
        response = self._group.generate.remote(
            payload, num_tokens=len(prompt_ids) + sampling["max_tokens"],
            block_hashes=extend_block_hashes([], prompt_ids, self.block_size))
        run = _Run(fmt, GroupStream(response), timer, len(prompt_ids),
                   sampling["logprobs"] is not None)
        if stream:
            return await self._start_stream(run)
        return JSONResponse(await self._collect(run))

    async def _collect(self, run: _Run) -> Dict[str, Any]:
        texts = []
        outcome = "abort"
        try:
            async for chunk in run.stream:
                texts.append(self._on_chunk(run, chunk))
            outcome = None
        except ProtocolError:
            outcome = "error"
            raise
        finally:
            self._end(run, outcome)
        return run.fmt.response("".join(texts), run.finish_reason, run.num_prompt_tokens,
                                run.num_output_tokens,
                                run.logprobs if run.want_logprobs else None)

    async def _start_stream(self, run: _Run) -> StreamingResponse:
        """Waits for the first chunk, so an error before it still gets its HTTP status."""
        try:
            first = await run.stream.__anext__()
        except BaseException as exc:
            self._end(run, "error" if isinstance(exc, Exception) else "abort")
            raise
        return StreamingResponse(self._events(run, first), media_type="text/event-stream")

    async def _events(self, run: _Run, first: Dict[str, Any]) -> AsyncIterator[str]:
        """The SSE stream. Starlette closes it when the client disconnects (and Serve cancels
        the replica's task): ``finally`` then cancels the group call."""
        outcome = "abort"
        try:
            for obj in run.fmt.start():
                yield sse_event(obj)
            chunk: Optional[Dict[str, Any]] = first
            while chunk is not None:
                num_logprobs = len(run.logprobs)
                text = self._on_chunk(run, chunk)
                new_logprobs = run.logprobs[num_logprobs:] if run.want_logprobs else None
                if text or new_logprobs:
                    yield sse_event(run.fmt.delta(text, new_logprobs))
                chunk = None if run.stream.finished else await run.stream.__anext__()
            yield sse_event(run.fmt.finish(run.finish_reason))
            if run.fmt.include_usage:
                yield sse_event(run.fmt.usage_chunk(run.num_prompt_tokens, run.num_output_tokens))
            outcome = None
            yield SSE_DONE
        except ProtocolError as exc:  # the group failed mid-stream: say so in the stream
            outcome = "error"
            yield sse_event(exc.body())
            yield SSE_DONE
        finally:
            self._end(run, outcome)

    def _on_chunk(self, run: _Run, chunk: Dict[str, Any]) -> str:
        run.timer.on_tokens(len(chunk["new_token_ids"]))
        run.num_output_tokens = chunk["num_output_tokens"]
        if chunk["finished"]:
            run.finish_reason = chunk["finish_reason"]
        if run.want_logprobs and chunk["logprobs"]:
            run.logprobs.extend(token_logprobs(chunk["logprobs"], self._token_text))
        return chunk["delta_text"]

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])

    def _end(self, run: _Run, outcome: Optional[str]) -> None:
        """Once per request: abort it in the group if unfinished, and record its metrics."""
        run.stream.cancel()
        if run.is_recorded:
            return
        run.is_recorded = True
        reason = outcome or run.finish_reason or "abort"
        self.metrics.record(run.timer, run.num_prompt_tokens, run.num_output_tokens, reason)

    async def _group_records(self) -> Mapping[str, GroupRecord]:
        try:
            return await asyncio.wait_for(self._store.snapshot.remote(),
                                          METRICS_STORE_TIMEOUT_S)
        except Exception as exc:  # the store is gone or slow: serve the ingress's own metrics
            logger.warning("metrics store unavailable (%s); group metrics omitted", exc)
            try:
                self._store = get_metrics_store()
            except Exception:
                logger.exception("cannot reach or recreate the metrics store")
            return {}


def build_ingress(groups: Application, model_dir: str, served_model_name: str, block_size: int,
                  max_model_len: int, api_key: Optional[str] = None) -> Application:
    """The application: this ingress bound in front of the (bound) group deployment."""
    return OpenAIIngress.bind(groups, model_dir, served_model_name, block_size, max_model_len,
                              api_key)
