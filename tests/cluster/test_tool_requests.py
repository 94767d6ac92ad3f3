"""A chat request's tools: the fields and their limits, the history's tool calls and results
rendered through real chat templates (tests/tool_models.py), the plan a request gets, and the
response shapes (message.tool_calls, delta.tool_calls, finish_reason)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.api.group_calls import with_tool_grammar
from cluster.api.openai_requests import ChatCompletionRequest
from cluster.app_config import ServeConfig
from cluster.options import engine_config
from cluster.api.prompts import PromptCodec
from cluster.api.protocol import ChatFormat, ChoiceResult, ProtocolError, validate_request
from cluster.api.tools.calls import ToolCall, ToolCallDelta
from cluster.api.tools.definitions import MAX_TOOLS
from cluster.api.tools.formats import HERMES, LLAMA3_JSON, server_format
from cluster.api.tools.plan import finish_reason, plan_tools
from cluster.serve_config import plan_from_cli, serve_config_from_args
from scripts.config_doc import tpserve_parser
from workers.config import EngineConfig
from workers.sampling_params import SamplingParams
from workers.structured.spec import MAX_SPEC_CHARS, GrammarKind, StructuredOutput

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def chat(**fields):
    return validate_request({"model": "m", "messages": HISTORY, **fields}, ChatCompletionRequest)


def refused(**fields) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        chat(**fields)
    return info.value


def test_tool_fields_and_their_defaults():
    req = chat(tools=[WEATHER])
    assert req.effective_tool_choice == "auto" and req.named_function is None
    assert chat().effective_tool_choice == "none"
    named = chat(tools=[WEATHER], tool_choice={"type": "function",
                                               "function": {"name": "get_weather"}})
    assert named.named_function == "get_weather"
    assert req.template_options()["tools"] == [WEATHER]
    assert "tools" not in chat().template_options()


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not among"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                for i in range(MAX_TOOLS + 1)]}, "tools", f"at most {MAX_TOOLS}"),
    ({"tools": [{"type": "function", "function": {"name": "big", "description": "x" *
                                                  MAX_SPEC_CHARS}}]}, "tools", "characters"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name", "pattern"),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected one of"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_tool_fields_are_400s_naming_the_field(fields, param, words):
    err = refused(**fields)
    assert err.param == param and words in err.message, (err.param, err.message)


def test_tool_call_arguments_must_be_a_json_object():
    for arguments, words in [('{"city": ', "invalid JSON"), ("[1, 2]", "got list")]:
        history = [HISTORY[0], {**HISTORY[1], "tool_calls": [
            CALL, {**CALL, "function": {"name": "f", "arguments": arguments}}]}]
        with pytest.raises(ProtocolError) as info:
            validate_request({"model": "m", "messages": history}, ChatCompletionRequest)
        param = "messages[1].tool_calls[1].function.arguments"
        assert info.value.param == param and words in info.value.message


@pytest.mark.parametrize("family,expected", [
    ("qwen2", ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
               '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call><|im_end|>',
               '<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n'
               '<|im_start|>assistant\n']),
    ("llama3", ["Environment: ipython",
                '{"type": "function", "function": {"name": "get_weather"',
                '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
                '"parameters": {"city": "Paris"}}<|eot_id|>',
                "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21 C<|eot_id|>"]),
])
def test_a_conversation_with_tools_renders_in_the_familys_format(tool_checkpoints, family,
                                                                  expected):
    codec = PromptCodec(tool_checkpoints(family))
    req = chat(tools=[WEATHER], tool_choice="none")
    ids = codec.chat_prompt_ids(req.messages, req.template_options(), None)
    text = codec.tokenizer.decode(ids)
    for part in expected:
        assert part in text, (part, text)
    fmt = server_format("auto", codec.tokenizer.chat_template)
    assert fmt is {"qwen2": HERMES, "llama3": LLAMA3_JSON}[family]


def test_the_plan_of_each_tool_choice(tool_checkpoints):
    tokenizer = PromptCodec(tool_checkpoints("qwen2")).tokenizer
    assert plan_tools(chat(), HERMES, tokenizer) is None
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), HERMES, tokenizer) is None
    auto = plan_tools(chat(tools=[WEATHER]), HERMES, tokenizer)
    assert auto.structured is None and auto.marker_token_id is None  # <tool_call>: plain text
    required = plan_tools(chat(tools=[WEATHER], tool_choice="required"), HERMES, tokenizer)
    assert required.structured.kind == GrammarKind.STRUCTURAL_TAG
    spec = json.loads(required.structured.spec)
    assert spec["format"]["type"] == "tags_with_separator"
    assert spec["format"]["stop_after_first"] is False
    single = plan_tools(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False),
                        HERMES, tokenizer)
    assert json.loads(single.structured.spec)["format"]["stop_after_first"] is True
    with pytest.raises(ProtocolError) as info:
        plan_tools(chat(tools=[WEATHER]), None, tokenizer)
    assert info.value.param == "tools" and "--tool-call-parser" in info.value.message


def test_the_tool_grammar_goes_to_the_engine_and_excludes_another_constraint():
    plan = plan_tools(chat(tools=[WEATHER], tool_choice="required"), HERMES, None)
    sampling = SamplingParams(max_tokens=5)
    assert with_tool_grammar(sampling, plan).structured == plan.structured
    assert with_tool_grammar(sampling, None) is sampling
    own = dataclasses.replace(sampling, structured=StructuredOutput(GrammarKind.JSON_OBJECT))
    with pytest.raises(ProtocolError) as info:
        with_tool_grammar(own, plan)
    assert info.value.param == "tool_choice" and "structured output" in info.value.message


def test_llama_python_tag_is_put_back_where_its_token_was(tool_checkpoints):
    tokenizer = PromptCodec(tool_checkpoints("llama3")).tokenizer
    plan = plan_tools(chat(tools=[WEATHER]), LLAMA3_JSON, tokenizer)
    tag_id = tokenizer.convert_tokens_to_ids("<|python_tag|>")
    assert plan.marker_token_id == tag_id
    choice = plan.choice()
    choice.add("", [tag_id])  # the detokenizer drops the special token's text
    choice.add('{"name": "get_weather", "parameters": {"city": "Rome"}}', [5, 6])
    assert choice.text.startswith("<|python_tag|>{")
    [call] = choice.result().calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Rome"}')


def test_responses_show_tool_calls_as_openai_does():
    fmt = ChatFormat("chatcmpl-1", 0, "m")
    call = ToolCall("call_a", "get_weather", '{"city": "Paris"}')
    body = fmt.response([ChoiceResult(None, "tool_calls", None, [call])], 3, 4)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None,
                                             "tool_calls": [call.openai()]}
    assert call.openai() == {"id": "call_a", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chunk = fmt.tool_delta([ToolCallDelta(0, "", "call_a", "get_weather"),
                            ToolCallDelta(1, '{"a"')], 2)
    assert chunk["choices"][0]["index"] == 2
    assert chunk["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 1, "function": {"arguments": '{"a"'}}]
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"


def test_the_tool_call_parser_option(capsys):
    parser = tpserve_parser()
    args = parser.parse_args(["serve", "--tool-call-parser", "hermes"])
    assert plan_from_cli(args, engine_config(args)).config.tool_call_parser == "hermes"
    assert ServeConfig(EngineConfig()).tool_call_parser == "auto"
    config = serve_config_from_args({"tool_call_parser": "mistral"}, {})
    assert config.tool_call_parser == "mistral"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        ServeConfig(EngineConfig(), tool_call_parser="granite")
