"""The gRPC API's protocol (``tpserve.v1``): requests in, responses out, errors as status codes.

Pure: no Ray. A proto request becomes the same pydantic request the HTTP API parses
(``cluster.api.openai_requests``), validated by the same code, so a bad value gets the same message
whichever protocol carried it; the rest of the path (tokenizing, the token budget, the group call)
is the ingress's, shared by both. Proto3 cannot tell an unset ``max_tokens`` from 0: 0 means
unset (the HTTP API's default). ``float`` fields are single precision on the wire: they are read
back as the shortest decimal that a float32 holds (0.8, not 0.800000011920929), so sampling sees
the value the client wrote. ``structured_output`` is read as the HTTP API's constraint
(`cluster.api.structured_requests`), its errors naming the proto's field.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

import grpc
import numpy as np

from cluster.api.protocol import ProtocolError, validate_request
from cluster.api.openai_requests import ChatCompletionRequest, CompletionRequest
from cluster.api.tools.calls import ToolCall, ToolCallDelta
from cluster.api.structured_requests import Constraint, constraint
from cluster.proto.tpserve.v1 import tpserve_pb2 as pb
from workers.structured.spec import GrammarKind

SERVICE_NAME = "tpserve.v1.TPServe"
SERVICER_FUNCTION = "cluster.proto.tpserve.v1.tpserve_pb2_grpc.add_TPServeServicer_to_server"

# Optional (presence-tracked) fields, sent on only when the client set them.
_OPTIONAL_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
_OPTIONAL_INTS = ("top_k", "seed")

# HTTP status (``ProtocolError.status``) -> gRPC status code.
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _float32_as_written(value: float) -> float:
    return float(str(np.float32(value)))


def _sampling_fields(request: Any) -> Dict[str, Any]:
    """The fields completions and chat share, as the HTTP API's JSON would carry them."""
    raw: Dict[str, Any] = {"model": request.model}
    if request.max_tokens:
        raw["max_tokens"] = request.max_tokens
    for name in _OPTIONAL_FLOATS:
        if request.HasField(name):
            raw[name] = _float32_as_written(getattr(request, name))
    for name in _OPTIONAL_INTS:
        if request.HasField(name):
            raw[name] = getattr(request, name)
    if request.stop:
        raw["stop"] = list(request.stop)
    if request.stop_token_ids:
        raw["stop_token_ids"] = list(request.stop_token_ids)
    if request.min_tokens:
        raw["min_tokens"] = request.min_tokens
    raw["ignore_eos"] = request.ignore_eos
    raw["include_stop_str_in_output"] = request.include_stop_str_in_output
    return raw


def completion_request(request: pb.CompletionRequest) -> CompletionRequest:
    """The HTTP API's completion request for a proto one; ``ProtocolError`` (400) if bad."""
    raw = _sampling_fields(request)
    if request.prompt and request.prompt_token_ids:
        raise ProtocolError("send either prompt or prompt_token_ids, not both", param="prompt")
    raw["prompt"] = list(request.prompt_token_ids) or request.prompt
    if request.HasField("add_special_tokens"):
        raw["add_special_tokens"] = request.add_special_tokens
    body = validate_request(raw, CompletionRequest)
    body.constrain(structured_constraint(request))
    return body


def chat_request(request: pb.ChatRequest) -> ChatCompletionRequest:
    """The HTTP API's chat request for a proto one; ``ProtocolError`` (400) if bad."""
    raw = _sampling_fields(request)
    raw["messages"] = [_chat_message(m) for m in request.messages]
    raw.update(_tool_fields(request))
    body = validate_request(raw, ChatCompletionRequest)
    body.constrain(structured_constraint(request))
    return body


def structured_constraint(request: Any) -> Optional[Constraint]:
    """The request's ``structured_output`` (None when unset, or ``json_object`` false); a 400
    naming the field when it is malformed."""
    if not request.HasField("structured_output"):
        return None
    message = request.structured_output
    kind = message.WhichOneof("kind")  # each field is named after its GrammarKind
    if kind is None:
        names = [f.name for f in message.DESCRIPTOR.oneofs_by_name["kind"].fields]
        raise ProtocolError(f"structured_output: set one of {', '.join(names)}",
                            param="structured_output")
    if kind == "json_object" and not message.json_object:
        return None
    value = list(message.choice.choices) if kind == "choice" else getattr(message, kind)
    return constraint(f"structured_output.{kind}", GrammarKind(kind), value,
                      any_whitespace=not message.disable_any_whitespace)


def _chat_message(message: pb.ChatMessage) -> Dict[str, Any]:
    raw: Dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        raw["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in message.tool_calls]
    if message.tool_call_id:
        raw["tool_call_id"] = message.tool_call_id
    return raw


def _tool_fields(request: pb.ChatRequest) -> Dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the HTTP API's JSON has them;
    a tool's ``parameters_json`` that is not JSON is a 400 naming it."""
    raw: Dict[str, Any] = {}
    if request.tools:
        raw["tools"] = [{"type": "function", "function": _function(i, t)}
                        for i, t in enumerate(request.tools)]
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if which == "mode":
        raw["tool_choice"] = request.tool_choice.mode
    elif which == "function":
        raw["tool_choice"] = {"type": "function",
                              "function": {"name": request.tool_choice.function}}
    if request.HasField("parallel_tool_calls"):
        raw["parallel_tool_calls"] = request.parallel_tool_calls
    return raw


def _function(index: int, tool: pb.Tool) -> Dict[str, Any]:
    function: Dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            function["parameters"] = json.loads(tool.parameters_json)
        except ValueError as exc:
            param = f"tools[{index}].parameters_json"
            raise ProtocolError(f"{param}: not JSON ({exc})", param=param) from None
    if tool.HasField("strict"):
        function["strict"] = tool.strict
    return function


def tool_calls(calls: Optional[Sequence[ToolCall]]) -> List[pb.ToolCall]:
    return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls or ()]


def tool_call_deltas(deltas: Sequence[ToolCallDelta]) -> List[pb.ToolCallDelta]:
    return [pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "",
                             arguments=d.arguments) for d in deltas]


def status_code(error: ProtocolError) -> grpc.StatusCode:
    """The gRPC status code that means what the HTTP API's status does."""
    if error.code == "overloaded":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return _STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens)


def completion_response(request_id: str, text: Optional[str], token_ids: Any,
                        finish_reason: Optional[str], num_prompt_tokens: int,
                        num_completion_tokens: int,
                        calls: Optional[Sequence[ToolCall]] = None) -> pb.CompletionResponse:
    return pb.CompletionResponse(id=request_id, text=text or "", token_ids=list(token_ids),
                                 finish_reason=finish_reason or "",
                                 usage=usage(num_prompt_tokens, num_completion_tokens),
                                 tool_calls=tool_calls(calls))
