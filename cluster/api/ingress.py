"""The OpenAI-compatible HTTP ingress: a FastAPI app served by a Ray Serve deployment.

Each request is authorized, parsed, tokenized (the checkpoint's tokenizer and chat template, on
a thread pool with a time bound: ``cluster.api.prompt_pool``, which also checks an output
constraint's schema, regex or grammar) and checked against the context length here, so bad
input gets a 4xx before anything is routed and the router knows the request's token count.
It then goes to a TP group through the group deployment's handle,
``generate(request, num_tokens=T, block_hashes=H)``
(``cluster.api.group_calls``; a batch of prompts as one request each), whose chunks
(``cluster.contract``: ``GroupRequest`` in, ``GroupChunk``s out) are turned into one OpenAI
response or a stream of server-sent events ending in ``data: [DONE]``. A client that goes away
cancels its handle call, which aborts the request in the engine. Endpoints:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
``/version`` (vLLM's shapes), ``/health`` (503 while no group serves), ``/metrics``. Every error
is OpenAI's error JSON; unexpected ones say nothing internal.
The same deployment answers the gRPC API (``tpserve.v1.TPServe``) for Serve's gRPC proxy: its
methods named after the RPCs hand over to ``cluster.api.grpc_service``, which takes the same path
(``authorize``, ``check_body``, ``admit``, ``completion_run`` / ``chat_run``).
"""

# No ``from __future__ import annotations`` here: Serve re-creates the route functions for the
# class-based view, and FastAPI must see the real ``Request`` annotation, not a string.
import asyncio
import json
import logging
import time
import uuid
from importlib.metadata import PackageNotFoundError, version as package_version
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Optional, Tuple, Type

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, BackpressureConfig
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from cluster.api.admission import IngressAdmission
from cluster.api.grpc_service import GrpcService
from cluster.api.api_key import ApiKey, KeyCheck
from cluster.api.metrics import IngressMetrics, RequestTimer
from cluster.api.prompts import PromptCodec
from cluster.api.group_calls import GroupRequests
from cluster.api.request_run import MigrationPolicy, RequestRun
from cluster.api.metrics_page import MetricsPage
from cluster.api.protocol import (
    ChatFormat,
    CompletionFormat,
    ProtocolError,
    R,
    error_body,
    models_list,
    parse_request,
    resolve_max_tokens,
)
from cluster.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    ignored_fields,
)
from cluster.api.openapi_schema import openapi_document
from cluster.api.prompt_pool import PromptPool
from cluster.api.structured_requests import Constraint
from cluster.api.tools.formats import AUTO, server_format
from cluster.api.tools.plan import plan_tools
from cluster.api.request_limits import (
    IngressLimits,
    check_declared_length,
    read_body,
    request_timeout_s,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
HEALTH_MAX_REPORT_AGE_S = 5.0  # groups report every second; a group silent this long is gone
INGRESS_EXTRA_ONGOING = 64  # beyond the generation slots: /health, /metrics, /tokenize, ...


def _json_object(raw: bytes) -> Dict[str, Any]:
    """``raw`` as a JSON object, or {} (parsing it again then says what is wrong)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def tpserve_version() -> str:
    try:
        return package_version("tpserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"

app = FastAPI(title="tpserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
app.openapi = lambda: openapi_document(app)  # the request bodies are parsed by hand


@app.exception_handler(ProtocolError)
async def _protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                   code=code), status_code=exc.status_code)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not bad input: logged with its traceback, answered without internals."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, group_handle: DeploymentHandle, model_dir: str, served_model_name: str,
                 block_size: int, max_model_len: int, api_key: Optional[ApiKey] = None,
                 limits: Optional[IngressLimits] = None, max_migrations: int = 3,
                 tool_call_parser: str = AUTO) -> None:
        if block_size < 1 or max_model_len < 2:
            raise ValueError(f"block_size must be >= 1 and max_model_len >= 2, got "
                             f"{block_size} and {max_model_len}")
        self.model_dir = str(model_dir)
        self.served_model_name = served_model_name
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._keys = KeyCheck(api_key)
        self._limits = limits or IngressLimits()
        self.prompts = PromptCodec(Path(model_dir))
        tokenizer = self.prompts.tokenizer
        # The model's tool-call format (None: requests with tools get a 400).
        self._tool_format = server_format(tool_call_parser,
                                          getattr(tokenizer, "chat_template", None))
        self._prompt_pool = PromptPool(self.prompts, self._limits)
        self.metrics = IngressMetrics(served_model_name, max_model_len, export_to_ray=True)
        self._page = MetricsPage(self.metrics)
        self._created = int(time.time())
        self._grpc = GrpcService(self)
        # A request whose group died waits for a healthy one as long as its own deadline.
        self._migration = MigrationPolicy(max_migrations=max_migrations,
                                          max_wait_s=self._limits.request_timeout_s)
        self._admission = IngressAdmission(self._limits.max_in_flight,
                                           self._limits.retry_after_s)
        self.metrics.track_admission(self._admission)
        self._requests = GroupRequests(group_handle, block_size, self.prompts, self.metrics,
                                       self._migration, self._admission)
        # One ingress per replica process: its /openapi.json names the model it serves.
        app.openapi_schema = None
        app.openapi = lambda: openapi_document(app, [served_model_name])

    # ----- endpoints -----

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._admitted(request, self._completion)

    async def _completion(self, request: Request, timer: RequestTimer,
                          limits: Dict[str, Any]) -> Response:
        body = self._parse(await self._body(request), CompletionRequest)
        return await self._respond(await self.completion_run(body, timer, **limits),
                                   body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._admitted(request, self._chat_completion)

    async def _chat_completion(self, request: Request, timer: RequestTimer,
                               limits: Dict[str, Any]) -> Response:
        body = self._parse(await self._body(request), ChatCompletionRequest)
        return await self._respond(await self.chat_run(body, timer, **limits), body.stream)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Dict[str, Any]:
        """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` with the template applied."""
        self._authorize(request)
        raw = await self._body(request)
        if "messages" in _json_object(raw):
            chat = self._parse(raw, TokenizeChatRequest)
            ids = await self._prompt_pool.chat_prompt_ids(chat)
            want_strs = chat.return_token_strs
        else:
            body = self._parse(raw, TokenizeCompletionRequest)
            [ids] = await self._prompt_pool.prompt_ids([body.prompt], body.add_special_tokens)
            want_strs = body.return_token_strs
        strs = self.prompts.token_strs(ids) if want_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Dict[str, Any]:
        self._authorize(request)
        body = self._parse(await self._body(request), DetokenizeRequest)
        self.prompts.check_token_ids(body.tokens, "tokens")
        [text] = await self._prompt_pool.texts([body.tokens])
        return {"prompt": text}

    @app.get("/version")
    async def version(self) -> Dict[str, str]:
        return {"version": tpserve_version()}

    @app.get("/v1/models")
    async def models(self, request: Request) -> Dict[str, Any]:
        self._authorize(request)
        return models_list(self.served_model_name, self.model_dir, self.max_model_len,
                           self._created)

    @app.get("/health")
    async def health(self) -> Response:
        """200 while at least one TP group serves (it reported a live engine within the last
        few seconds); 503 otherwise, as a load balancer expects."""
        num_serving = len(await self._page.serving_groups(HEALTH_MAX_REPORT_AGE_S))
        if num_serving == 0:
            return JSONResponse(error_body("no TP group can serve requests yet",
                                           "server_error", code="no_healthy_group"), 503)
        return JSONResponse({"status": "ok", "groups": num_serving})

    @app.get("/metrics")
    async def metrics_text(self) -> Response:
        """Every ingress replica's numbers summed, and every group's (``MetricsPage``)."""
        return Response(await self._page.text(), media_type=CONTENT_TYPE_LATEST)

    # ----- gRPC (tpserve.v1.TPServe): Serve's gRPC proxy calls the method named after the RPC
    # (so these names are CamelCase) and passes the call's context as ``grpc_context``

    async def Complete(self, request: Any, grpc_context: Any) -> Any:
        return await self._grpc.complete(request, grpc_context)

    async def CompleteStream(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async for chunk in self._grpc.complete_stream(request, grpc_context):
            yield chunk

    async def Chat(self, request: Any, grpc_context: Any) -> Any:
        return await self._grpc.chat(request, grpc_context)

    async def ChatStream(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        async for chunk in self._grpc.chat_stream(request, grpc_context):
            yield chunk

    async def ListModels(self, request: Any, grpc_context: Any) -> Any:
        return await self._grpc.list_models(request, grpc_context)

    # ----- the request path both protocols share -----

    async def completion_run(self, body: CompletionRequest, timer: RequestTimer, *,
                             timeout_s: float, release: Callable[[], None]) -> RequestRun:
        """Tokenize and check a completion request, and send it to a TP group; ``release``
        (the admission slot's) is called when the run ends."""
        await self._prompt_pool.check_constraint(body.constraint)
        prompt_ids = await self._prompt_pool.prompt_ids(body.prompts, body.add_special_tokens)
        max_tokens = [resolve_max_tokens(body.max_tokens, len(ids), self.max_model_len,
                                         default=DEFAULT_COMPLETION_MAX_TOKENS)
                      for ids in prompt_ids]
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", int(time.time()),
                               self.served_model_name, body.include_usage)
        echo = await self._prompt_pool.texts(prompt_ids) if body.echo else []
        return self._requests.start(fmt, body, max_tokens, prompt_ids, timer, echo,
                                    timeout_s=timeout_s, release=release)

    async def chat_run(self, body: ChatCompletionRequest, timer: RequestTimer, *,
                       timeout_s: float, release: Callable[[], None]) -> RequestRun:
        """Apply the chat template, check the request, and send it to a TP group."""
        tools = plan_tools(body, self._tool_format, self.prompts.tokenizer)
        await self._prompt_pool.check_constraint(body.constraint)
        if tools is not None and tools.structured is not None:  # required or named
            await self._prompt_pool.check_constraint(Constraint("tools", tools.structured))
        prompt_ids = await self._prompt_pool.chat_prompt_ids(body)
        max_tokens = resolve_max_tokens(body.requested_max_tokens, len(prompt_ids),
                                        self.max_model_len, param=body.max_tokens_param,
                                        prompt_param="messages")
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()),
                         self.served_model_name, body.include_usage)
        return self._requests.start(fmt, body, [max_tokens], [prompt_ids], timer,
                                    timeout_s=timeout_s, release=release, tools=tools)

    def authorize(self, authorization: Optional[str]) -> None:
        """Checks an ``Authorization`` header's (or gRPC metadata's) value against the key."""
        self._page.start()  # this replica's numbers reach the store from its first request on
        self._keys.authorize(authorization)

    def check_body(self, body: R) -> R:
        """Check a request's model (when it names one); log the fields it ignores."""
        name = getattr(body, "model", None)
        if name is not None and name not in (self.served_model_name, self.model_dir):
            raise ProtocolError(f"the model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", 404, param="model",
                                code="model_not_found")
        ignored = ignored_fields(body)
        if ignored:
            logger.warning("request fields ignored (not OpenAI or vLLM parameters): %s",
                           ignored)
        return body

    def admit(self) -> Callable[[], None]:
        """One of this replica's generation slots (429 when none is free): its release."""
        return self._admission.acquire()

    @property
    def request_timeout_s(self) -> float:
        return self._limits.request_timeout_s

    # ----- limits -----

    async def _admitted(self, request: Request, handler: Callable[..., Awaitable[Response]]
                        ) -> Response:
        """Runs a generation endpoint's ``handler`` in one of this replica's slots (429 when
        none is free), with the request's time limit. A stream holds its slot until it ends."""
        timer = RequestTimer()
        self._authorize(request)
        timeout_s = request_timeout_s(request.headers, self._limits.request_timeout_s)
        check_declared_length(request.headers, self._limits.max_body_bytes)
        release = self.admit()
        try:
            response = await handler(request, timer, {"timeout_s": timeout_s,
                                                      "release": release})
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()
        return response

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self._limits.max_body_bytes)

    # ----- checks -----

    def _authorize(self, request: Request) -> None:
        self.authorize(request.headers.get("authorization"))

    def _parse(self, raw: bytes, model: Type[R]) -> R:
        return self.check_body(parse_request(raw, model))

    @staticmethod
    async def _respond(run: RequestRun, stream: bool) -> Response:
        if stream:
            first = await run.first_chunk()
            return StreamingResponse(run.events(first), media_type="text/event-stream")
        return JSONResponse(await run.collect())


def build_ingress(groups: Application, model_dir: str, served_model_name: str, block_size: int,
                  max_model_len: int, api_key: Optional[ApiKey] = None,
                  limits: Optional[IngressLimits] = None, max_migrations: int = 3,
                  replicas: Tuple[int, int] = (1, 1), tool_call_parser: str = AUTO
                  ) -> Application:
    """The application: this ingress bound in front of the (bound) group deployment. Each
    replica takes ``limits.max_in_flight`` generation requests plus room for the cheap
    endpoints; Serve's proxy queues a bounded number beyond that (``cluster.api.admission``).
    ``replicas``: (MIN, MAX); MIN < MAX autoscales on requests in flight per replica.
    ``tool_call_parser``: the model's tool-call format (`cluster.api.tools.formats`)."""
    limits = limits or IngressLimits()
    low, high = replicas
    scaling: Dict[str, Any] = {"num_replicas": low}
    if high > low:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=low, max_replicas=high,
            target_ongoing_requests=max(1, limits.max_in_flight // 2))}
    ingress = OpenAIIngress.options(
        max_ongoing_requests=limits.max_in_flight + INGRESS_EXTRA_ONGOING,
        # Serve counts a request as queued while it picks a replica for it, so a burst of
        # arrivals fills this queue even while the replica has room: keep the same slack.
        max_queued_requests=limits.max_in_flight + INGRESS_EXTRA_ONGOING,
        backpressure_config=BackpressureConfig(status_code=429,
                                               retry_after_s=limits.retry_after_s),
        **scaling)
    return ingress.bind(groups, model_dir, served_model_name, block_size, max_model_len,
                        api_key, limits, max_migrations, tool_call_parser)
