"""`workers.structured.syntax`: a constraint's grammar built without a tokenizer; what cannot
be built is a ValueError naming the kind, in xgrammar's words."""

from __future__ import annotations

import json
import time

import pytest

from workers.structured.spec import MAX_JSON_DEPTH, GrammarKind, StructuredOutput, json_depth
from workers.structured.syntax import check_syntax


@pytest.mark.parametrize("kind,spec", [
    (GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name"]})),
    (GrammarKind.JSON_SCHEMA, "true"),
    (GrammarKind.JSON_OBJECT, ""),
    (GrammarKind.REGEX, r"\d{3}-[a-z]+"),
    (GrammarKind.GRAMMAR, 'root ::= "yes" | "no"'),
    (GrammarKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>",
        "content": {"type": "json_schema", "json_schema": {"type": "object"}}}})),
])
def test_well_formed_constraints_pass(kind, spec):
    check_syntax(StructuredOutput(kind, spec))
    check_syntax(StructuredOutput(kind, spec, any_whitespace=False))


def test_a_choice_always_passes():
    check_syntax(StructuredOutput(GrammarKind.CHOICE, choices=("[a-", "(")))


@pytest.mark.parametrize("kind,spec,words", [
    (GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "pattern": "[a-"}), "Unclosed '['"),
    (GrammarKind.JSON_SCHEMA, json.dumps({"$ref": "#/$defs/Missing"}), "$defs"),
    (GrammarKind.JSON_SCHEMA, json.dumps({"type": "strin"}), 'Unsupported type "strin"'),
    (GrammarKind.REGEX, "(ab", "regex"),
    (GrammarKind.GRAMMAR, "root ::= item", 'Rule "item" is not defined'),
    (GrammarKind.GRAMMAR, 'start ::= "a"', "root"),
    (GrammarKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag"}), "format"),
])
def test_malformed_constraints_are_value_errors_naming_the_kind(kind, spec, words):
    with pytest.raises(ValueError) as info:
        check_syntax(StructuredOutput(kind, spec))
    message = str(info.value)
    assert message.startswith(f"invalid {kind.value}: ") and words in message, message
    assert ".cc:" not in message  # xgrammar's source location is not the client's business


def test_json_depth_counts_containers_outside_strings():
    assert json_depth('"x"') == 0
    assert json_depth('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth('{"a": "\\"[[["}') == 1


@pytest.mark.parametrize("kind", [GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG])
def test_a_spec_nested_past_the_limit_is_a_value_error_on_construction(kind):
    # xgrammar's time grows with the cube of the depth (1000 levels take minutes), and Python's
    # JSON parser raised RecursionError (not ValueError) at about 1000.
    deep = '{"anyOf":[' * 1000 + "{}" + "]}" * 1000
    with pytest.raises(ValueError, match=f"nests 2001 objects and arrays deep; at most "
                                         f"{MAX_JSON_DEPTH}"):
        StructuredOutput(kind, deep)


def test_a_schema_at_the_depth_limit_builds_quickly():
    levels = MAX_JSON_DEPTH // 2 - 1
    at_limit = '{"anyOf":[' * levels + '{"items":{}}' + "]}" * levels
    assert json_depth(at_limit) == MAX_JSON_DEPTH
    start = time.monotonic()
    check_syntax(StructuredOutput(GrammarKind.JSON_SCHEMA, at_limit))
    assert time.monotonic() - start < 1.0
