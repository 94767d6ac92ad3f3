"""OpenAI's HTTP protocol: request models, the token budget, response and chunk builders, errors.

Pure: no Ray, no FastAPI. Requests are parsed from raw bytes so that every bad input (invalid
JSON, a wrong type, an unsupported option) becomes a 400 in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` naming the field, not FastAPI's 422.
Extensions beyond OpenAI's fields (as in vLLM): ``top_k``, ``ignore_eos``, ``stop_token_ids``.
Unknown fields are ignored; known but unsupported options (``n > 1``, ``echo``, penalties,
``logit_bias``, tools) are refused rather than silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Literal,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Prompt = Union[str, List[int]]
R = TypeVar("R", bound=BaseModel)


# ----- errors -----


class ProtocolError(Exception):
    """A request the server refuses; carries the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_request(body: bytes, model: Type[R]) -> R:
    """Parse and validate a JSON body; raises ``ProtocolError`` (400) naming the bad field."""
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(raw, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(raw).__name__}")
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


# ----- requests -----


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with the usage.")


class _SamplingFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="The served model name (or the model directory).")
    max_tokens: Optional[int] = Field(None, description="Most tokens to generate.")
    temperature: Optional[float] = Field(None, description="0 is greedy; default 1.")
    top_p: Optional[float] = Field(None, description="Nucleus sampling mass; default 1.")
    top_k: Optional[int] = Field(None, description="Extension: sample among the k likeliest.")
    n: int = Field(1, description="Number of choices; only 1 is supported.")
    stream: bool = Field(False, description="Stream chunks by server-sent events.")
    stream_options: Optional[StreamOptions] = Field(None, description="Streaming options.")
    stop: Optional[Union[str, List[str]]] = Field(None, description="Stop strings.")
    stop_token_ids: Optional[List[int]] = Field(None, description="Extension: stop tokens.")
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64,
                                description="Makes sampling reproducible (a 64-bit integer).")
    user: Optional[str] = Field(None, description="An end-user id (logged, not used).")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    presence_penalty: Optional[float] = Field(None, description="Unsupported unless 0.")
    frequency_penalty: Optional[float] = Field(None, description="Unsupported unless 0.")
    logit_bias: Optional[Dict[str, float]] = Field(None, description="Unsupported unless empty.")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: Optional[float]) -> Optional[float]:
        if value:
            raise ValueError("penalties are not supported (leave unset or 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: Optional[Dict[str, float]]) -> Optional[Dict[str, float]]:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_logprobs(self) -> Optional[int]:
        raise NotImplementedError

    def sampling(self, max_tokens: int) -> Dict[str, Any]:
        """The ``sampling`` dict of the group payload (``workers.sampling_params`` fields)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.requested_logprobs(),
        }


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text, token ids, or a list holding one of those)."""

    prompt: Union[str, List[int], List[str], List[List[int]]] = Field(
        description="Text, token ids, or a one-element list of either.")
    logprobs: Optional[int] = Field(None, description="Top log-probabilities per token (0-20).")
    echo: bool = Field(False, description="Unsupported: must be false.")
    best_of: Optional[int] = Field(None, description="Unsupported unless 1.")
    suffix: Optional[str] = Field(None, description="Unsupported.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Prompt:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"batched prompts are not supported: send one prompt per "
                                 f"request (got {len(prompt)})")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt is empty")
        if isinstance(prompt, list) and min(prompt) < 0:
            raise ValueError("prompt token ids must be non-negative")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: Optional[int]) -> Optional[int]:
        if best_of not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {best_of}")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Optional[str]) -> Optional[str]:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Only 'text' is supported.")
    text: Optional[str] = Field(None, description="The text of a 'text' part.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = Field(None, description="Text or parts.")
    name: Optional[str] = Field(None, description="The author's name.")

    def template_message(self) -> Dict[str, str]:
        """The message as the chat template sees it: text parts joined by newlines."""
        content = self.content
        if isinstance(content, list):
            bad = sorted({p.type for p in content if p.type != "text"})
            if bad:
                raise ProtocolError(f"only text content parts are supported, got {bad}",
                                    param="messages")
            content = "\n".join(p.text or "" for p in content)
        message = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; the prompt is the checkpoint's chat template applied."""

    messages: List[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: Optional[int] = Field(None, description="Preferred to max_tokens.")
    logprobs: bool = Field(False, description="Return the sampled tokens' log-probabilities.")
    top_logprobs: Optional[int] = Field(None, description="Alternatives per token (0-20).")
    tools: Optional[List[Any]] = Field(None, description="Unsupported unless empty.")
    response_format: Optional[Dict[str, Any]] = Field(None, description="Only type 'text'.")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: Optional[List[Any]]) -> Optional[List[Any]]:
        if tools:
            raise ValueError("tools are not supported")
        return tools

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if fmt and fmt.get("type", "text") != "text":
            raise ValueError(f"only response_format type 'text' is supported, got {fmt}")
        return fmt

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


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


def token_logprobs(entries: Sequence[Dict[str, Any]], decode: Callable[[int], str]
                   ) -> List[TokenLogprob]:
    """Chunk logprobs (``{"token_id", "logprob", "top_logprobs": [[id, lp], ...]}``) as text."""
    return [TokenLogprob(decode(e["token_id"]), e["logprob"],
                         tuple((decode(i), lp) for i, lp in e.get("top_logprobs", ())))
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


class CompletionFormat:
    """Builds one ``/v1/completions`` response or its stream of ``text_completion`` chunks."""

    object_name = "text_completion"

    def __init__(self, request_id: str, created: int, model: str,
                 include_usage: bool = False) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.include_usage = include_usage
        self._text_offset = 0

    def _envelope(self, choices: List[Dict[str, Any]], **extra: Any) -> Dict[str, Any]:
        body = {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}
        if self.include_usage and "usage" not in body:
            body["usage"] = None
        return body

    def _choice(self, text: str, finish_reason: Optional[str],
                logprobs: Optional[Sequence[TokenLogprob]]) -> Dict[str, Any]:
        lp = None
        if logprobs is not None:
            lp = completion_logprobs(logprobs, self._text_offset)
        self._text_offset += len(text)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def start(self) -> List[Dict[str, Any]]:
        return []

    def delta(self, text: str, logprobs: Optional[Sequence[TokenLogprob]]) -> Dict[str, Any]:
        return self._envelope([self._choice(text, None, logprobs)])

    def finish(self, finish_reason: Optional[str]) -> Dict[str, Any]:
        return self._envelope([self._choice("", finish_reason, None)])

    def usage_chunk(self, num_prompt: int, num_completion: int) -> Dict[str, Any]:
        return self._envelope([], usage=usage(num_prompt, num_completion))

    def response(self, text: str, finish_reason: Optional[str], num_prompt: int,
                 num_completion: int, logprobs: Optional[Sequence[TokenLogprob]]
                 ) -> Dict[str, Any]:
        return {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": [self._choice(text, finish_reason, logprobs)],
                "usage": usage(num_prompt, num_completion)}


class ChatFormat(CompletionFormat):
    """Builds one ``chat.completion`` response or its ``chat.completion.chunk`` stream: the
    first chunk carries the role, the next ones content, the last one the finish reason."""

    object_name = "chat.completion.chunk"

    def _chunk(self, delta: Dict[str, Any], finish_reason: Optional[str],
               logprobs: Optional[Sequence[TokenLogprob]] = None) -> Dict[str, Any]:
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        return self._envelope([{"index": 0, "delta": delta, "logprobs": lp,
                                "finish_reason": finish_reason}], system_fingerprint=None)

    def start(self) -> List[Dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, text: str, logprobs: Optional[Sequence[TokenLogprob]]) -> Dict[str, Any]:
        return self._chunk({"content": text}, None, logprobs)

    def finish(self, finish_reason: Optional[str]) -> Dict[str, Any]:
        return self._chunk({}, finish_reason)

    def usage_chunk(self, num_prompt: int, num_completion: int) -> Dict[str, Any]:
        return self._envelope([], system_fingerprint=None,
                              usage=usage(num_prompt, num_completion))

    def response(self, text: str, finish_reason: Optional[str], num_prompt: int,
                 num_completion: int, logprobs: Optional[Sequence[TokenLogprob]]
                 ) -> Dict[str, Any]:
        return {
            "id": self.request_id, "object": "chat.completion", "created": self.created,
            "model": self.model, "system_fingerprint": None,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                         "finish_reason": finish_reason}],
            "usage": usage(num_prompt, num_completion),
        }


def models_list(model_id: str, root: str, max_model_len: int, created: int) -> Dict[str, Any]:
    return {"object": "list", "data": [{
        "id": model_id, "object": "model", "created": created, "owned_by": "tpserve",
        "root": root, "max_model_len": max_model_len}]}
