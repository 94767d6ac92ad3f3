"""The request fields that constrain the output (`cluster.api.structured_requests`): every
spelling OpenAI and vLLM send becomes one `StructuredOutput` in the request's `SamplingParams`;
two constraints, unknown keys, refused options and specs past the limits are 400s naming the
field; a schema, regex or grammar that cannot be built is a 400 naming the field from the
prompt pool, without Ray."""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field, conint, constr

from cluster.api.openai_requests import ChatCompletionRequest, CompletionRequest
from cluster.api.prompt_pool import PromptPool
from cluster.api.prompts import PromptCodec
from cluster.api.protocol import ProtocolError, parse_request
from cluster.api.request_limits import IngressLimits
from workers.structured.spec import MAX_CHOICES, MAX_SPEC_CHARS, GrammarKind, StructuredOutput

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    return parse_request(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(),
                         CompletionRequest)


def structured(build=chat, **fields) -> StructuredOutput:
    return build(**fields).sampling(8).structured


def refused(build=chat, **fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        build(**fields)
    assert info.value.status == 400
    return info.value


class Mood(str, Enum):
    happy = "happy"
    sad = "sad"


class Answer(BaseModel):
    mood: Mood
    sure: bool
    score: conint(ge=0, le=9)
    word: constr(max_length=5)
    kind: Literal["a", "b"] = Field(description="one letter")


def test_the_openai_sdk_parse_body_is_a_json_schema_constraint():
    from openai.lib._parsing._completions import type_to_response_format_param

    fmt = type_to_response_format_param(Answer)  # what chat.completions.parse sends
    for build in (chat, completion):
        out = structured(build, response_format=fmt)
        assert out.kind == GrammarKind.JSON_SCHEMA and out.any_whitespace
        assert json.loads(out.spec) == fmt["json_schema"]["schema"]
    body = chat(response_format=fmt, structured_outputs={"disable_any_whitespace": True})
    assert body.constraint.param == "response_format.json_schema.schema"
    assert not body.sampling(8).structured.any_whitespace


@pytest.mark.parametrize("fields,want", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(GrammarKind.JSON_OBJECT)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": False, "description": "d"}}},
     StructuredOutput(GrammarKind.JSON_SCHEMA, COMPACT)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(GrammarKind.JSON_SCHEMA, COMPACT)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}},
     StructuredOutput(GrammarKind.REGEX, "[a-z]+")),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     StructuredOutput(GrammarKind.JSON_SCHEMA, COMPACT)),  # xgrammar's strict mode: always
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutput(GrammarKind.CHOICE, choices=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutput(GrammarKind.GRAMMAR, 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     StructuredOutput(GrammarKind.JSON_OBJECT, any_whitespace=False)),
    ({"structured_outputs": {"structural_tag": '{"type":"structural_tag","format":{}}'}},
     StructuredOutput(GrammarKind.STRUCTURAL_TAG, '{"type":"structural_tag","format":{}}')),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
     StructuredOutput(GrammarKind.JSON_SCHEMA, COMPACT)),
    ({"guided_regex": r"\d+", "guided_decoding_backend": "auto"},
     StructuredOutput(GrammarKind.REGEX, r"\d+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutput(GrammarKind.CHOICE, choices=("a", "b"))),
    ({"guided_grammar": 'root ::= "b"'}, StructuredOutput(GrammarKind.GRAMMAR, 'root ::= "b"')),
    ({"response_format": {"type": "text"}, "structured_outputs": {"json_object": False}}, None),
    ({}, None),
])
def test_every_spelling_becomes_one_structured_output(fields, want):
    assert structured(chat, **fields) == want
    assert structured(completion, **fields) == want


def test_the_older_structural_tag_form_reads_as_triggered_tags():
    out = structured(response_format={"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=x>", "schema": SCHEMA, "end": "</f>"}]})
    assert json.loads(out.spec) == {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "tags": [
            {"begin": "<f=x>", "end": "</f>",
             "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "response_format and guided_json both constrain the output"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_regex and guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_grammar": "root ::= \"a\""},
     "guided_grammar", "structured_outputs.regex and guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA, "choice": ["a"]}}, "structured_outputs.choice",
     "structured_outputs.json and structured_outputs.choice"),
])
def test_two_constraints_are_a_400_naming_both(fields, param, words):
    err = refused(**fields)
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "a JSON schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
     "response_format.json_schema.x", "not a field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "expected a JSON json_schema"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema",
     "not a field"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "not a field"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"disable_additional_properties": 1}},
     "structured_outputs.disable_additional_properties", "expected a bool"),
    ({"structured_outputs": {"disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "expected a bool"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object",
     "expected true or false"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "expected a string"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "list of strings"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "'outlines'"),
    ({"guided_choice": []}, "guided_choice", "1 to"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ({"guided_regex": ""}, "guided_regex", "non-empty spec"),
])
def test_malformed_or_refused_fields_are_a_400_naming_them(fields, param, words):
    err = refused(**fields)
    assert err.param == param and words in err.message, (err.param, err.message)


def test_the_limits_are_a_400_naming_the_field():
    err = refused(guided_regex="a" * (MAX_SPEC_CHARS + 1))
    assert err.param == "guided_regex" and f"at most {MAX_SPEC_CHARS}" in err.message
    err = refused(guided_choice=[str(i) for i in range(MAX_CHOICES + 1)])
    assert err.param == "guided_choice" and f"1 to {MAX_CHOICES}" in err.message
    deep = json.loads('{"items":' * 200 + "{}" + "}" * 200)
    err = refused(response_format={"type": "json_schema", "json_schema": {"schema": deep}})
    assert err.param == "response_format.json_schema.schema" and "nests 201" in err.message
    err = refused(structured_outputs={"json": '{"not":' * 5000 + "{}" + "}" * 5000})
    assert err.param == "structured_outputs.json" and "nests 5001" in err.message

    body = b'{"model": "m", "prompt": "hi", "guided_json": ' + b"[" * 10**5 + b"]" * 10**5 + b"}"
    with pytest.raises(ProtocolError, match="nests too deep") as info:  # not RecursionError
        parse_request(body, CompletionRequest)
    assert info.value.status == 400


# ----- the syntax check on the prompt pool -----

@pytest.fixture(scope="module")
def pool(tiny_llama):
    return PromptPool(PromptCodec(tiny_llama), IngressLimits())


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}},
     "response_format.json_schema.schema", "Unclosed '['"),
    ({"guided_json": {"$ref": "#/$defs/Missing"}}, "guided_json", "$defs"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar",
     'Rule "x" is not defined'),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
     "structured_outputs.structural_tag", "format"),
])
def test_a_spec_that_cannot_build_is_a_400_from_the_pool(pool, fields, param, words):
    body = chat(**fields)  # well-formed as far as the request's parser can tell
    with pytest.raises(ProtocolError) as info:
        asyncio.run(pool.check_constraint(body.constraint))
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"{param}: invalid ") and words in info.value.message


def test_well_formed_specs_pass_the_pool(pool):
    for fields in ({"guided_json": SCHEMA}, {"guided_regex": "[ab]+"}, {"guided_choice": ["x"]},
                   {"response_format": {"type": "json_object"}}, {}):
        asyncio.run(pool.check_constraint(chat(**fields).constraint))


def test_a_check_past_the_bound_is_a_400_saying_so(tiny_llama):
    pool = PromptPool(PromptCodec(tiny_llama), IngressLimits(prompt_timeout_s=0.005))
    levels = 63  # within the depth limit, tens of milliseconds to build (xgrammar lets go of
    # the GIL meanwhile: the event loop runs, and stops the check when xgrammar returns)
    slow = '{"type":"object","properties":{"a":' * levels + "{}" + "}}" * levels
    body = chat(guided_json=json.loads(slow))
    with pytest.raises(ProtocolError, match="checking the output constraint took longer") as info:
        asyncio.run(pool.check_constraint(body.constraint))
    assert info.value.param == "guided_json"


# ----- the gRPC API's structured_output -----

def test_grpc_structured_output_fields_keep_their_numbers():
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb

    for request in (pb.CompletionRequest, pb.ChatRequest):
        assert request.DESCRIPTOR.fields_by_name["structured_output"].number == 30
    assert {f.name: f.number for f in pb.StructuredOutput.DESCRIPTOR.fields} == {
        "json_schema": 1, "json_object": 2, "regex": 3, "choice": 4, "grammar": 5,
        "structural_tag": 6, "disable_any_whitespace": 7}


def test_grpc_structured_output_is_the_same_constraint():
    from cluster.api.grpc_protocol import chat_request, completion_request
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb

    def grpc_chat(**fields):
        return chat_request(pb.ChatRequest(model="m", messages=[pb.ChatMessage(
            role="user", content="hi")], structured_output=pb.StructuredOutput(**fields)))

    def grpc_completion(**fields):
        return completion_request(pb.CompletionRequest(
            model="m", prompt="hi", structured_output=pb.StructuredOutput(**fields)))

    for build in (grpc_chat, grpc_completion):
        body = build(json_schema=COMPACT, disable_any_whitespace=True)
        assert body.constraint.param == "structured_output.json_schema"
        assert body.sampling(8).structured == StructuredOutput(
            GrammarKind.JSON_SCHEMA, COMPACT, any_whitespace=False)
        assert build(choice=pb.Choices(choices=["a", "b"])).sampling(8).structured == \
            StructuredOutput(GrammarKind.CHOICE, choices=("a", "b"))
        assert build(regex="a+").constraint.output == StructuredOutput(GrammarKind.REGEX, "a+")
        assert build(json_object=True).constraint.output.kind == GrammarKind.JSON_OBJECT
        assert build(json_object=False).constraint is None
    assert completion_request(pb.CompletionRequest(model="m", prompt="hi")).constraint is None
    for fields, param in [({}, "structured_output"),
                          ({"choice": pb.Choices()}, "structured_output.choice"),
                          ({"json_schema": "[1]"}, "structured_output.json_schema"),
                          ({"grammar": ""}, "structured_output.grammar")]:
        with pytest.raises(ProtocolError) as info:
            grpc_chat(**fields)
        assert info.value.param == param and info.value.message.startswith(param), fields
