"""The request fields that constrain a completion's output, as OpenAI and vLLM spell them, on
``/v1/completions`` and ``/v1/chat/completions``; each request has at most one constraint, a
`workers.structured.spec.StructuredOutput` with the field that carries it (``Constraint``).

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` (what
  the OpenAI SDK's ``chat.completions.parse(response_format=Model)`` sends; ``strict`` false is
  enforced all the same), ``{"type": "structural_tag", "format": {...}}`` (xgrammar's structural
  tag; the older ``structures`` / ``triggers`` form is read as its ``triggered_tags``).
- vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar`` (EBNF,
  root rule ``root``), ``json_object``, ``structural_tag``; options ``disable_any_whitespace``
  (JSON without free whitespace), ``disable_fallback`` (there is no fallback: xgrammar is the
  only backend), ``disable_additional_properties`` (what happens anyway: the engine compiles
  schemas in xgrammar's strict mode, where an object without ``additionalProperties`` takes no
  other properties); ``whitespace_pattern`` is refused by name. The options also apply to a
  constraint sent in another field.
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
  ``guided_decoding_backend`` "xgrammar" or "auto"; ``guided_whitespace_pattern`` refused.

Two constraints in one request, an unknown key, a spec over ``MAX_SPEC_CHARS`` or nested deeper
than ``MAX_JSON_DEPTH``, or more than ``MAX_CHOICES`` choices are a 400 naming the field. Whether
the schema, regex or grammar compiles is checked later, off the event loop
(`workers.structured.syntax.check_syntax`, through `cluster.api.prompt_pool`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from cluster.api.protocol import ProtocolError
from workers.structured.spec import MAX_JSON_DEPTH, GrammarKind, StructuredOutput

BACKENDS = (None, "xgrammar", "auto")
_KINDS = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX,
          "choice": GrammarKind.CHOICE, "grammar": GrammarKind.GRAMMAR,
          "json_object": GrammarKind.JSON_OBJECT,
          "structural_tag": GrammarKind.STRUCTURAL_TAG}
_OPTIONS = {"disable_any_whitespace": bool, "disable_fallback": bool,
            "disable_additional_properties": bool, "whitespace_pattern": str}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint and the request field that carries it (its errors name
    ``param``)."""

    param: str
    output: StructuredOutput


def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(f"{param}: {message}", param=param)


def constraint(param: str, kind: GrammarKind, value: Any = None,
               any_whitespace: bool = True) -> Constraint:
    """The constraint of ``kind`` that the field ``param`` sends: ``value`` is the schema (JSON
    text, an object or a boolean), the regex, the grammar, the structural tag (text or object),
    the list of choices, or nothing (json_object). A 400 naming ``param`` if it is malformed."""
    try:
        if kind == GrammarKind.CHOICE:
            if not isinstance(value, list):
                raise ValueError(f"expected a list of strings, got {type(value).__name__}")
            output = StructuredOutput(kind, choices=tuple(value))
        else:
            output = StructuredOutput(kind, _spec_text(kind, value),
                                      any_whitespace=any_whitespace)
    except ValueError as exc:
        raise _bad(param, str(exc)) from None
    return Constraint(param, output)


def _spec_text(kind: GrammarKind, value: Any) -> str:
    if kind == GrammarKind.JSON_OBJECT:
        return ""
    if kind in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG) and \
            isinstance(value, (dict, bool)):
        try:
            return json.dumps(value, separators=(",", ":"))
        except RecursionError:  # deeper than Python's JSON encoder goes
            raise ValueError(f"nests too deep; at most {MAX_JSON_DEPTH} objects and arrays "
                             f"deep are accepted") from None
    if kind in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG) and \
            not isinstance(value, str):
        raise ValueError(f"expected a JSON {kind.value} (an object, or its JSON text), got "
                         f"{type(value).__name__}")
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _from_response_format(fmt: Dict[str, Any]) -> Optional[Constraint]:
    kind = fmt.get("type", "text")
    if kind == "text":
        _only_keys(fmt, ("type",), "response_format")
        return None
    if kind == "json_object":
        _only_keys(fmt, ("type",), "response_format")
        return constraint("response_format", GrammarKind.JSON_OBJECT)
    if kind == "json_schema":
        _only_keys(fmt, ("type", "json_schema"), "response_format")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema", f"expected an object with "
                       f"{', '.join(_JSON_SCHEMA_KEYS)}, got {spec!r:.100}")
        _only_keys(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
        if spec.get("schema") is None:
            raise _bad("response_format.json_schema.schema", "a JSON schema is required")
        return constraint("response_format.json_schema.schema", GrammarKind.JSON_SCHEMA,
                          spec["schema"])
    if kind == "structural_tag":
        return constraint("response_format", GrammarKind.STRUCTURAL_TAG,
                          _structural_tag(fmt))
    raise _bad("response_format.type", f"expected one of text, json_object, json_schema, "
               f"structural_tag; got {kind!r:.100}")


def _structural_tag(fmt: Dict[str, Any]) -> Dict[str, Any]:
    """xgrammar's structural tag; the older form (``structures`` of ``begin``, ``schema``,
    ``end``, and ``triggers``) as the ``triggered_tags`` format that means the same."""
    if "format" in fmt or not ("structures" in fmt or "triggers" in fmt):
        return fmt
    _only_keys(fmt, ("type", "structures", "triggers"), "response_format")
    structures = fmt.get("structures")
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise _bad("response_format.structures", "expected a list of objects with begin, "
                   "schema and end")
    tags = [{"begin": s.get("begin"), "end": s.get("end"),
             "content": {"type": "json_schema", "json_schema": s.get("schema")}}
            for s in structures]
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": fmt.get("triggers"), "tags": tags}}


def _only_keys(obj: Dict[str, Any], accepted: Tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in accepted:
            raise _bad(f"{where}.{key}", f"not a field of {where} (expected "
                       f"{', '.join(accepted)}); leave it out")


def _structured_outputs(fields: Dict[str, Any]) -> Tuple[Optional[Tuple[str, Any]], bool]:
    """vLLM's ``structured_outputs``: its constraint as (key, value), if any, and whether JSON
    may have free whitespace."""
    _only_keys(fields, tuple(_KINDS) + tuple(_OPTIONS), "structured_outputs")
    for key, kind in _OPTIONS.items():
        value = fields.get(key)
        if value is not None and not isinstance(value, kind):
            raise _bad(f"structured_outputs.{key}", f"expected a {kind.__name__}, got "
                       f"{value!r:.100}")
    if fields.get("whitespace_pattern") is not None:
        raise _bad("structured_outputs.whitespace_pattern", "not supported by this server "
                   "(use disable_any_whitespace); leave it unset")
    json_object = fields.get("json_object")
    if json_object not in (None, True, False):
        raise _bad("structured_outputs.json_object", f"expected true or false, got "
                   f"{json_object!r:.100}")
    sent = [(key, fields[key]) for key in _KINDS
            if fields.get(key) is not None and (key != "json_object" or json_object)]
    if len(sent) > 1:
        first, second = (f"structured_outputs.{key}" for key, _ in sent[:2])
        raise _bad(second, f"{first} and {second} both constrain the output; send one")
    return (sent[0] if sent else None), not fields.get("disable_any_whitespace", False)


def requested_constraint(body: "StructuredFields") -> Optional[Constraint]:
    """The one constraint of a request's fields (None: unconstrained); a 400 naming the field
    for a malformed or refused one, and naming both for two."""
    if body.guided_whitespace_pattern is not None:
        raise _bad("guided_whitespace_pattern", "not supported by this server (use "
                   "structured_outputs.disable_any_whitespace); leave it unset")
    if body.guided_decoding_backend not in BACKENDS:
        raise _bad("guided_decoding_backend", f"this server's only backend is xgrammar; "
                   f"send 'xgrammar', 'auto' or nothing, got {body.guided_decoding_backend!r}")
    sent, any_whitespace = _structured_outputs(body.structured_outputs or {})
    found: List[Constraint] = []
    fmt = _from_response_format(body.response_format or {})
    if fmt is not None:
        found.append(fmt)
    if sent is not None:
        key, value = sent
        found.append(constraint(f"structured_outputs.{key}", _KINDS[key], value))
    for field, key in _GUIDED.items():
        if getattr(body, field) is not None:
            found.append(constraint(field, _KINDS[key], getattr(body, field)))
    if len(found) > 1:
        first, second = found[0].param, found[1].param
        raise _bad(second, f"{first} and {second} both constrain the output; send one")
    if not found:
        return None
    return dataclasses.replace(found[0], output=dataclasses.replace(
        found[0].output, any_whitespace=any_whitespace))


class StructuredFields(BaseModel):
    """The fields that constrain the output; ``constraint`` is what they ask for."""

    model_config = ConfigDict(extra="allow")

    response_format: Optional[Dict[str, Any]] = Field(
        None, description="{type: text | json_object | json_schema | structural_tag}.")
    structured_outputs: Optional[Dict[str, Any]] = Field(
        None, description="vLLM's: one of json, regex, choice, grammar, json_object, "
                          "structural_tag; disable_any_whitespace.")
    guided_json: Optional[Union[str, bool, Dict[str, Any]]] = Field(
        None, description="A JSON schema the output matches (vLLM's older spelling).")
    guided_regex: Optional[str] = Field(None, description="A regex the output matches.")
    guided_choice: Optional[List[str]] = Field(None, description="The output is one of these.")
    guided_grammar: Optional[str] = Field(None, description="An EBNF grammar (root rule root).")
    guided_decoding_backend: Optional[str] = Field(None, description="xgrammar or auto.")
    guided_whitespace_pattern: Optional[str] = Field(None, description="Refused unless null.")

    _constraint: Optional[Constraint] = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredFields":
        self._constraint = requested_constraint(self)
        return self

    @property
    def constraint(self) -> Optional[Constraint]:
        return self._constraint

    def constrain(self, constraint: Optional[Constraint]) -> None:
        """Sets the constraint from another protocol's field (the gRPC API's)."""
        self._constraint = constraint
