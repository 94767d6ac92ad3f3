"""OpenAI's HTTP protocol: parsing, the token budget, response and chunk builders, errors.

Pure: no Ray, no FastAPI. Requests (``cluster.api.openai_requests``) are parsed from raw bytes so
that every bad input (invalid JSON, a wrong type, an unsupported option) becomes a 400 in
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` naming the field, not
FastAPI's 422.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
)

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:  # the engine's type, without importing torch into the protocol
    from cluster.api.tools.calls import ToolCall, ToolCallDelta
    from workers.sampler import SampledToken

R = TypeVar("R", bound=BaseModel)


# ----- errors -----


class ProtocolError(Exception):
    """A request the server refuses; carries the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None,
                 retry_after_s: Optional[float] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s  # 429 / 503: when the client may try again

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> Dict[str, str]:
        """``Retry-After`` in whole seconds (RFC 9110), rounded up, when one is set."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(0, math.ceil(self.retry_after_s)))}


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_request(body: bytes, model: Type[R]) -> R:
    """Parse and validate a JSON body; raises ``ProtocolError`` (400) naming the bad field."""
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}", code="invalid_json")
    except RecursionError:
        raise ProtocolError("request body nests too deep for this server's JSON parser",
                            code="invalid_json") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(raw).__name__}")
    return validate_request(raw, model)


def validate_request(raw: Dict[str, Any], model: Type[R]) -> R:
    """Validate a decoded body (from JSON, or a gRPC request's fields); raises
    ``ProtocolError`` (400) naming the bad field."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        param, message = _describe(exc.errors())
        raise ProtocolError(message, param=param)


def _is_union_tag(part: Any) -> bool:
    """Pydantic puts the member's type (``str``, ``list[int]``, ``ContentPart``) in the path."""
    return isinstance(part, str) and ("[" in part or part[:1].isupper() or part in
                                      ("str", "int", "float", "bool"))


def _describe(errors: List[Dict[str, Any]]) -> Tuple[Optional[str], str]:
    """The first validation error as ``(param, message)``; a union lists the shapes it takes."""
    loc = errors[0]["loc"]
    tags = [p for p in loc if _is_union_tag(p)]
    if tags:
        head = loc[:loc.index(tags[0])]
        options = dict.fromkeys(str(e["loc"][len(head)]) for e in errors
                                if e["loc"][:len(head)] == head and len(e["loc"]) > len(head))
        path = ".".join(map(str, head))
        return path or None, f"{path}: expected one of {', '.join(options)}"
    path = ".".join(map(str, loc))
    message = errors[0]["msg"].removeprefix("Value error, ")
    if not path or message.startswith(str(loc[-1])):
        return path or None, message
    return path, f"{path}: {message}"


# ----- the token budget -----


def resolve_max_tokens(requested: Optional[int], num_prompt_tokens: int, max_model_len: int,
                       default: Optional[int] = None, param: str = "max_tokens",
                       prompt_param: str = "prompt") -> int:
    """How many tokens to generate: ``requested`` if it fits the context, else a 400.

    An unset ``requested`` takes ``default`` clipped to the room left (or all the room)."""
    if num_prompt_tokens >= max_model_len:
        raise ProtocolError(
            f"the prompt has {num_prompt_tokens} tokens, but this model's context is "
            f"{max_model_len} tokens (prompt plus at least one generated token); "
            f"shorten the prompt", param=prompt_param, code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise ProtocolError(f"{param} must be at least 1, got {requested}", param=param)
    if requested > room:
        raise ProtocolError(
            f"{param}={requested} plus the prompt's {num_prompt_tokens} tokens exceeds this "
            f"model's context of {max_model_len} tokens; {param} can be at most {room}",
            param=param, code="context_length_exceeded")
    return requested


# ----- log-probabilities -----


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: Tuple[Tuple[str, float], ...] = ()


def token_logprobs(entries: Sequence[SampledToken], decode: Callable[[int], str]
                   ) -> List[TokenLogprob]:
    """A chunk's logprobs (`cluster.contract.GroupChunk.logprobs`) as text."""
    return [TokenLogprob(decode(e.token_id), e.logprob,
                         tuple((decode(i), lp) for i, lp in e.top_logprobs))
            for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> Dict[str, Any]:
    """The legacy completions shape; ``text_offset`` is where the first token starts."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob]) -> Dict[str, Any]:
    def item(token: str, logprob: float) -> Dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


# ----- responses -----


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def sse_event(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceResult:
    """One choice as the response shows it. With ``tool_calls``, ``text`` None is a chat
    message's null content."""

    text: Optional[str]
    finish_reason: Optional[str]
    logprobs: Optional[Sequence[TokenLogprob]] = None
    tool_calls: Optional[Sequence[ToolCall]] = None


class CompletionFormat:
    """Builds one ``/v1/completions`` response or its stream of ``text_completion`` chunks.

    ``usage`` on a chunk is what ``stream_options.continuous_usage_stats`` asks for."""

    object_name = "text_completion"

    def __init__(self, request_id: str, created: int, model: str,
                 include_usage: bool = False) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.include_usage = include_usage
        self._text_offsets: Dict[int, int] = {}  # per choice: where its next text starts

    def _envelope(self, choices: List[Dict[str, Any]], usage_now: Optional[Dict[str, int]] = None,
                  **extra: Any) -> Dict[str, Any]:
        body = {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}
        if usage_now is not None:
            body["usage"] = usage_now
        elif self.include_usage:
            body["usage"] = None
        return body

    def _choice(self, index: int, text: str, finish_reason: Optional[str],
                logprobs: Optional[Sequence[TokenLogprob]]) -> Dict[str, Any]:
        offset = self._text_offsets.get(index, 0)
        lp = completion_logprobs(logprobs, offset) if logprobs is not None else None
        self._text_offsets[index] = offset + len(text)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def start(self, num_choices: int = 1) -> List[Dict[str, Any]]:
        return []

    def delta(self, text: str, logprobs: Optional[Sequence[TokenLogprob]], index: int = 0,
              usage_now: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        return self._envelope([self._choice(index, text, None, logprobs)], usage_now)

    def finish(self, finish_reason: Optional[str], index: int = 0,
               usage_now: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        return self._envelope([self._choice(index, "", finish_reason, None)], usage_now)

    def usage_chunk(self, num_prompt: int, num_completion: int) -> Dict[str, Any]:
        return self._envelope([], usage(num_prompt, num_completion))

    def response(self, choices: Sequence[ChoiceResult], num_prompt: int,
                 num_completion: int) -> Dict[str, Any]:
        return {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.model,
                "choices": [self._choice(i, c.text, c.finish_reason, c.logprobs)
                            for i, c in enumerate(choices)],
                "usage": usage(num_prompt, num_completion)}


class ChatFormat(CompletionFormat):
    """Builds one ``chat.completion`` response or its ``chat.completion.chunk`` stream: each
    choice's first chunk carries the role, the next ones content or tool calls
    (``delta.tool_calls``), the last one the finish reason."""

    object_name = "chat.completion.chunk"

    def _chunk(self, index: int, delta: Dict[str, Any], finish_reason: Optional[str],
               logprobs: Optional[Sequence[TokenLogprob]] = None,
               usage_now: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        return self._envelope([{"index": index, "delta": delta, "logprobs": lp,
                                "finish_reason": finish_reason}], usage_now,
                              system_fingerprint=None)

    def start(self, num_choices: int = 1) -> List[Dict[str, Any]]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None)
                for i in range(num_choices)]

    def delta(self, text: str, logprobs: Optional[Sequence[TokenLogprob]], index: int = 0,
              usage_now: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        return self._chunk(index, {"content": text}, None, logprobs, usage_now)

    def finish(self, finish_reason: Optional[str], index: int = 0,
               usage_now: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        return self._chunk(index, {}, finish_reason, None, usage_now)

    def tool_delta(self, calls: Sequence[ToolCallDelta], index: int = 0,
                   usage_now: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        return self._chunk(index, {"tool_calls": [c.openai() for c in calls]}, None, None,
                           usage_now)

    def usage_chunk(self, num_prompt: int, num_completion: int) -> Dict[str, Any]:
        return self._envelope([], usage(num_prompt, num_completion), system_fingerprint=None)

    @staticmethod
    def message(choice: ChoiceResult) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:
            message["tool_calls"] = [call.openai() for call in choice.tool_calls]
        return message

    def response(self, choices: Sequence[ChoiceResult], num_prompt: int,
                 num_completion: int) -> Dict[str, Any]:
        return {
            "id": self.request_id, "object": "chat.completion", "created": self.created,
            "model": self.model, "system_fingerprint": None,
            "choices": [{"index": i, "message": self.message(c),
                         "logprobs": chat_logprobs(c.logprobs) if c.logprobs is not None
                         else None, "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)],
            "usage": usage(num_prompt, num_completion),
        }


def models_list(model_id: str, root: str, max_model_len: int, created: int) -> Dict[str, Any]:
    return {"object": "list", "data": [{
        "id": model_id, "object": "model", "created": created, "owned_by": "tpserve",
        "root": root, "max_model_len": max_model_len}]}
