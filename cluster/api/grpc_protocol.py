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

from typing import Any, Dict, Optional

import grpc
import numpy as np

from cluster.api.protocol import ProtocolError, validate_request
from cluster.api.openai_requests import ChatCompletionRequest, CompletionRequest
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
    raw["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
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


def status_code(error: ProtocolError) -> grpc.StatusCode:
    """The gRPC status code that means what the HTTP API's status does."""
    if error.code == "overloaded":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return _STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens)


def completion_response(request_id: str, text: str, token_ids: Any,
                        finish_reason: Optional[str], num_prompt_tokens: int,
                        num_completion_tokens: int) -> pb.CompletionResponse:
    return pb.CompletionResponse(id=request_id, text=text, token_ids=list(token_ids),
                                 finish_reason=finish_reason or "",
                                 usage=usage(num_prompt_tokens, num_completion_tokens))
