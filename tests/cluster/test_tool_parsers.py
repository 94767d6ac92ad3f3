"""The tool-call parsers of cluster/api/tools: each format's text to content and calls, whole and
streamed in any split (the streamed deltas add up to the whole parse)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from cluster.api.tools.call_stream import CallStream, parse, stream_parse
from cluster.api.tools.formats import (FORMATS, HERMES, LLAMA3_JSON, MISTRAL, detect_format,
                                       server_format)

ARGS = [{"city": "Paris", "days": 3}, {}, {"q": "a \"quoted\" } brace ] and \\ slash",
                                           "nested": {"list": [1, {"x": None}], "t": True}}]


def render(fmt, calls):
    """Calls as the model writes them in ``fmt``; ``calls``: (name, arguments) pairs."""
    key = fmt.args_keys[0]
    objects = ['{"name": "%s", "%s": %s}' % (name, key, json.dumps(args)) for name, args in calls]
    if fmt is HERMES:
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if fmt is LLAMA3_JSON:
        return "; ".join(objects)
    return "[TOOL_CALLS][" + ", ".join(objects) + "]"


def summary(parsed):
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_plain_text_is_content(fmt):
    for text in ["", "hello world", "a < b and [x] {not a call}", "ends with <tool_ca",
                 "[TOOL_CALL", "  spaced  "]:
        parsed = parse(fmt, text)
        assert (parsed.content, parsed.calls) == (text, [])


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_one_call_and_several_calls(fmt):
    one = parse(fmt, render(fmt, [("get_weather", ARGS[0])]))
    assert summary(one) == (None, [("get_weather", ARGS[0])])
    assert one.calls[0].arguments == json.dumps(ARGS[0])  # as the model wrote it
    assert one.calls[0].id.startswith("call_") and len(one.calls[0].id) == 29
    calls = [("a", ARGS[0]), ("b", ARGS[1]), ("c", ARGS[2])]
    several = parse(fmt, render(fmt, calls))
    assert summary(several) == (None, calls)
    assert len({c.id for c in several.calls}) == 3


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=list(FORMATS))
def test_calls_after_text(fmt):
    text = "Let me look that up.\n" + render(fmt, [("f", ARGS[2])]) + "\n"
    assert summary(parse(fmt, text)) == ("Let me look that up.", [("f", ARGS[2])])


def test_llama_python_tag_and_parameters_or_arguments():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}};{"name": "g", "arguments": {}}'
    assert summary(parse(LLAMA3_JSON, text)) == (None, [("f", {"a": 1}), ("g", {})])


@pytest.mark.parametrize("fmt,text", [
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": [1}}\n</tool_call> after'),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1'),
    (HERMES, '<tool_call>{"arguments": {}, "name": "f"}</tool_call>'),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"a": tru}}'),
    (LLAMA3_JSON, '{"name": f, "parameters": {}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": "not an object"}]'),
    (MISTRAL, '[TOOL_CALLS] no list'),
])
def test_malformed_calls_stay_content(fmt, text):
    assert summary(parse(fmt, text)) == (text, [])
    stream_parse(fmt, list(text))  # streamed character by character: no error


def test_a_malformed_call_after_a_good_one_keeps_the_good_one():
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": }}'
    assert summary(parse(LLAMA3_JSON, text)) == (
        '; {"name": "g", "parameters": {"b": }}', [("f", {"a": 1})])


def test_stream_sends_the_name_first_then_argument_fragments():
    stream = CallStream(HERMES)
    pieces = ["Sure.\n<tool", '_call>\n{"name": "get_', 'weather", "argu', 'ments": {"ci',
              'ty": "Pa', 'ris"}}\n</tool_call>']
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    assert deltas[0].content == "Sure." and not deltas[0].calls
    assert [d.calls for d in deltas[1:3]] == [[], []]  # the name is not complete yet
    [first] = deltas[3].calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "{\"ci")
    assert first.id.startswith("call_")
    assert first.openai()["type"] == "function"
    rest = [c for d in deltas[4:] for c in d.calls]
    assert all(c.name is None and c.index == 0 for c in rest)
    assert "".join(c.arguments for c in [first, *rest]) == '{"city": "Paris"}'
    assert rest[0].openai() == {"index": 0, "function": {"arguments": 'ty": "Pa'}}
    assert "".join(d.content for d in deltas) == "Sure."


def pieces_of(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


_name = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
_args = st.dictionaries(st.text(max_size=6), _json, max_size=4)
_prose = st.text(st.characters(blacklist_characters="{[<"), max_size=20)


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(list(FORMATS.values())), before=_prose,
       calls=st.lists(st.tuples(_name, _args), max_size=3),
       cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_streamed_in_any_split_equals_the_whole_parse(fmt, before, calls, cuts):
    text = before + (render(fmt, calls) if calls else "")
    whole = parse(fmt, text)
    assert summary(whole)[1] == [(n, a) for n, a in calls]
    streamed = stream_parse(fmt, pieces_of(text, cuts))
    assert summary(streamed) == summary(whole)
    assert [c.arguments for c in streamed.calls] == [c.arguments for c in whole.calls]


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(list(FORMATS.values())),
       text=st.lists(st.sampled_from(list('{}[]",:;<>/ \\ab\n') + [
           "<tool_call>", "</tool_call>", "[TOOL_CALLS]", '"name"', '"arguments"']),
           max_size=40).map("".join),
       cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_arbitrary_text_never_breaks_the_parser(fmt, text, cuts):
    whole = parse(fmt, text)
    if not whole.calls:
        assert whole.content == text
    stream_parse(fmt, pieces_of(text, cuts))


def test_the_format_is_detected_from_the_chat_template():
    assert detect_format("...{{ '<tool_call>' }}...") is HERMES
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>") is LLAMA3_JSON
    assert detect_format({"default": "[AVAILABLE_TOOLS] [TOOL_CALLS]"}) is MISTRAL
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None
    assert server_format("auto", None) is None
    assert server_format("mistral", "<tool_call>") is MISTRAL
    with pytest.raises(ValueError, match="--tool-call-parser"):
        server_format("granite", None)
