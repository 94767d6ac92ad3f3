"""Per-request limits at the ingress: the body's size and the request's time.

- The body is read with ``read_body``: a ``Content-Length`` above ``max_body_bytes`` is refused
  before a byte is read, and a body sent without one (chunked) is refused as soon as it grows
  past the limit, so a replica never holds more than the limit of any one body. 413.
- A generation request has a deadline: the server's ``request_timeout_s``, or sooner when the
  client sends ``X-Request-Timeout: <seconds>`` (a positive number; the smaller one wins).
  ``DeadlineStream`` wraps the request's group stream: past the deadline it cancels the group
  call (which aborts the request in the engine and frees its KV blocks) and raises a 504, which
  the ingress answers as OpenAI's error JSON, or as an error event then ``[DONE]`` mid-stream.
- A chat template sent in a request (``chat_template``, ``chat_template_kwargs.chat_template``)
  is a Jinja program the ingress would run: refused with a 400 naming the field unless the
  server trusts them (``--trust-request-chat-template``), and then of at most
  ``max_chat_template_chars``. Rendering and tokenizing a request's prompts is bounded by
  ``prompt_timeout_s`` (``cluster.api.prompt_pool``).

Pure: no Ray (Starlette's ``Request`` only).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, Tuple

from starlette.requests import Request

from cluster.api.admission import DEFAULT_RETRY_AFTER_S
from cluster.api.protocol import ProtocolError
from cluster.contract import GroupChunk

TIMEOUT_HEADER = "X-Request-Timeout"
MIB = 1 << 20


@dataclass(frozen=True)
class IngressLimits:
    """What one ingress replica allows; derived from ``ServeConfig`` in ``cluster.app``."""

    max_in_flight: int = 1024  # generation requests admitted at once (429 beyond)
    max_body_bytes: int = 4 * MIB  # 413 beyond
    request_timeout_s: float = 600.0  # 504 beyond (clients may ask for less)
    retry_after_s: float = DEFAULT_RETRY_AFTER_S  # the Retry-After of a 429 or 503
    trust_request_chat_template: bool = False  # else a request's chat template is a 400
    max_chat_template_chars: int = 64 * 1024  # a trusted request's template; 400 beyond
    prompt_timeout_s: float = 10.0  # rendering and tokenizing a request's prompts; 400 beyond

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise ValueError(f"request_timeout_s must be a positive number of seconds, got "
                             f"{self.request_timeout_s}")
        if not self.retry_after_s >= 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_chat_template_chars < 1:
            raise ValueError(f"max_chat_template_chars must be at least 1, got "
                             f"{self.max_chat_template_chars}")
        if not (self.prompt_timeout_s > 0 and math.isfinite(self.prompt_timeout_s)):
            raise ValueError(f"prompt_timeout_s must be a positive number of seconds, got "
                             f"{self.prompt_timeout_s}")


def body_too_large(max_bytes: int, what: str) -> ProtocolError:
    return ProtocolError(f"the request body ({what}) exceeds this server's limit of "
                         f"{max_bytes} bytes ({max_bytes / MIB:g} MiB); send a smaller request",
                         413, code="request_too_large")


def check_declared_length(headers: Mapping[str, str], max_bytes: int) -> None:
    """A 413 for a ``Content-Length`` past ``max_bytes``, before any of the body is read."""
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes, f"Content-Length {int(declared)}")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or a 413 once it is known to pass ``max_bytes``."""
    check_declared_length(request.headers, max_bytes)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes, f"more than {size} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def check_chat_templates(templates: Sequence[Tuple[str, Any]], limits: IngressLimits) -> None:
    """A 400 naming the field for a request's own chat template (``(field, template)`` pairs)
    unless the server trusts them; a trusted one must be a string within the size limit."""
    for param, template in templates:
        if not limits.trust_request_chat_template:
            raise ProtocolError(f"{param}: this server applies only the model's own chat "
                                f"template; a template sent in a request runs only on a server "
                                f"started with --trust-request-chat-template", param=param)
        if not isinstance(template, str):
            raise ProtocolError(f"{param}: expected a Jinja template (a string), got "
                                f"{type(template).__name__}", param=param)
        if len(template) > limits.max_chat_template_chars:
            raise ProtocolError(f"{param}: a chat template of {len(template)} characters; this "
                                f"server takes at most {limits.max_chat_template_chars}",
                                param=param)


def request_timeout_s(headers: Mapping[str, str], server_timeout_s: float) -> float:
    """The request's time limit: the server's, or the client's ``X-Request-Timeout`` when
    smaller. A header that is not a positive number is a 400 naming it."""
    raw = headers.get(TIMEOUT_HEADER.lower())
    if raw is None:
        return server_timeout_s
    try:
        client_s = float(raw)
    except ValueError:
        client_s = math.nan
    if not (client_s > 0 and math.isfinite(client_s)):
        raise ProtocolError(f"header {TIMEOUT_HEADER} must be a positive number of seconds, "
                            f"got {raw!r}", param=TIMEOUT_HEADER)
    return min(client_s, server_timeout_s)


def timed_out(timeout_s: float) -> ProtocolError:
    return ProtocolError(f"the request did not finish within its time limit of {timeout_s:g} s "
                         f"and was aborted (the limit is the server's --request-timeout-s, or "
                         f"the client's {TIMEOUT_HEADER} header when smaller)", 504,
                         code="request_timeout")


class ChunkStream(Protocol):
    finished: bool

    async def __anext__(self) -> GroupChunk: ...

    def cancel(self) -> None: ...


class DeadlineStream:
    """A group stream that ends with a 504 at ``time.monotonic() + timeout_s``: the group
    call is cancelled first, so the engine aborts the request and frees its blocks."""

    def __init__(self, stream: ChunkStream, timeout_s: float,
                 start: Optional[float] = None) -> None:
        self._stream = stream
        self.timeout_s = timeout_s
        self.deadline = (time.monotonic() if start is None else start) + timeout_s

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def __aiter__(self) -> "DeadlineStream":
        return self

    async def __anext__(self) -> GroupChunk:
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self._stream.__anext__(), remaining)
        except TimeoutError:
            self._stream.cancel()
            raise timed_out(self.timeout_s) from None

    def cancel(self) -> None:
        self._stream.cancel()
