"""The OpenAPI description the ingress serves at ``/openapi.json``.

The endpoints parse their bodies by hand (``cluster.api.protocol.parse_request``: every bad
body is a 400 in OpenAI's error shape, not FastAPI's 422), so FastAPI cannot see them: this
module fills in each POST endpoint's request body from the pydantic models of
``cluster.api.openai_requests``, and its error responses as OpenAI's error object. Pure.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Type

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from cluster.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from cluster.api.request_limits import TIMEOUT_HEADER

REQUEST_BODIES: Dict[str, Sequence[Type[BaseModel]]] = {
    "/v1/completions": (CompletionRequest,),
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: Dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {
    "400": "Bad input; the message names the field.", "401": "Missing or wrong API key.",
    "404": "Unknown model.", "413": "The body is larger than the server's limit.",
    "429": "At the server's limit of requests in flight; see Retry-After.",
    "503": "No TP group can serve; see Retry-After.",
    "504": "The request ran past its time limit and was aborted.",
}


def _schema(model: Type[BaseModel], components: Dict[str, Any],
            model_names: Optional[List[str]]) -> Dict[str, Any]:
    """``model``'s schema under ``components``; a ``model`` field lists the served names."""
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    if model_names and "model" in schema.get("properties", {}):
        schema["properties"]["model"] = {**schema["properties"]["model"], "enum": model_names}
        schema["properties"]["model"].pop("anyOf", None)
        schema["properties"]["model"].setdefault("type", "string")
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _error_responses(path: str) -> Dict[str, Any]:
    codes = [c for c in _ERRORS if path in GENERATION_PATHS or c not in ("429", "503", "504")]
    return {code: {"description": _ERRORS[code], "content": {"application/json": {
        "schema": {"$ref": _REF.format(model="ErrorResponse")}}}} for code in codes}


def openapi_document(app: FastAPI, model_names: Optional[List[str]] = None) -> Dict[str, Any]:
    """FastAPI's description of ``app`` with the request bodies and errors filled in;
    ``model_names``: the names the ``model`` field accepts. Cached on the app."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of tpserve (plus vLLM's /tokenize "
                                  "and /detokenize).")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    for path, models in REQUEST_BODIES.items():
        operation = doc.get("paths", {}).get(path, {}).get("post")
        if operation is None:
            continue
        refs = [_schema(m, components, model_names) for m in models]
        schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema}}}
        operation["responses"].update(_error_responses(path))
        operation["responses"].pop("422", None)
        if path in GENERATION_PATHS:
            operation["parameters"] = [{
                "name": TIMEOUT_HEADER, "in": "header", "required": False,
                "description": "Seconds this request may take (the server's limit if smaller)",
                "schema": {"type": "number", "exclusiveMinimum": 0}}]
    app.openapi_schema = doc
    return doc
