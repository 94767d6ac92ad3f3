"""The gRPC API's tool fields (tpserve.v1): converted to the HTTP API's request, with the same
errors, and tool calls in its responses."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc")
from cluster.api.grpc_protocol import chat_request, completion_response  # noqa: E402
from cluster.api.protocol import ProtocolError  # noqa: E402
from cluster.api.tools.calls import ToolCall  # noqa: E402
from cluster.proto.tpserve.v1 import tpserve_pb2 as pb  # noqa: E402

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = pb.Tool(name="get_weather", description="forecast", parameters_json=json.dumps(SCHEMA))
HISTORY = [pb.ChatMessage(role="user", content="weather?"),
           pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
               id="call_1", name="get_weather", arguments='{"city": "Oslo"}')]),
           pb.ChatMessage(role="tool", tool_call_id="call_1", content="snow")]


def test_tools_choice_and_history_arrive_as_on_the_http_api():
    body = chat_request(pb.ChatRequest(model="m", messages=HISTORY, tools=[TOOL],
                                       tool_choice=pb.ToolChoice(function="get_weather"),
                                       parallel_tool_calls=False))
    assert body.template_tools() == [{"type": "function", "function": {
        "name": "get_weather", "description": "forecast", "parameters": SCHEMA}}]
    assert body.named_function == "get_weather" and body.parallel_tool_calls is False
    assert [m.template_message(i) for i, m in enumerate(body.messages)][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "snow", "tool_call_id": "call_1"}]
    unset = chat_request(pb.ChatRequest(model="m", messages=HISTORY[:1], tools=[TOOL]))
    assert unset.effective_tool_choice == "auto" and unset.parallel_tool_calls is None
    required = chat_request(pb.ChatRequest(model="m", messages=HISTORY[:1], tools=[TOOL],
                                           tool_choice=pb.ToolChoice(mode="required")))
    assert required.effective_tool_choice == "required"


@pytest.mark.parametrize("request_fields,param", [
    (dict(tools=[pb.Tool(name="f", parameters_json="{oops")]), "tools[0].parameters_json"),
    (dict(tools=[TOOL], tool_choice=pb.ToolChoice(function="nope")), "tool_choice"),
    (dict(tool_choice=pb.ToolChoice(mode="required")), "tool_choice"),
    (dict(tool_choice=pb.ToolChoice(mode="often"), tools=[TOOL]), "tool_choice"),
])
def test_bad_tool_fields_name_the_field(request_fields, param):
    with pytest.raises(ProtocolError) as info:
        chat_request(pb.ChatRequest(model="m", messages=HISTORY[:1], **request_fields))
    assert info.value.param == param, info.value.message


def test_a_response_carries_the_calls():
    call = ToolCall("call_9", "get_weather", '{"city": "Oslo"}')
    response = completion_response("chatcmpl-1", None, [5, 6], "tool_calls", 3, 2, [call])
    assert response.text == "" and response.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in response.tool_calls] == [
        ("call_9", "get_weather", '{"city": "Oslo"}')]
