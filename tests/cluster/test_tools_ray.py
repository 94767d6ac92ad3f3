"""Tool calling through the served ingress on a real local Ray Serve, with the official `openai`
client: a tiny random Qwen2.5-style checkpoint (tests/tool_models.py: ``<tool_call>`` in its
chat template, so the hermes format is detected) behind a one-engine group deployment (the real
engine and the TP group's streaming, as in ingress_app.py). ``required`` and named choices are enforced by the engine's grammar, so a
random model's calls still parse and validate; ``none`` gives plain text after a tool result.
"""

from __future__ import annotations

import json
import sys

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from ray import cloudpickle, serve  # noqa: E402

from cluster.api.api_key import ApiKey  # noqa: E402
from cluster.api.grpc_service import grpc_options  # noqa: E402
from cluster.api.ingress import build_ingress  # noqa: E402
from cluster.contract import GroupRequest  # noqa: E402
from cluster.groups.stream import stream_chunks  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from tool_models import MAX_MODEL_LEN  # noqa: E402
from workers.async_engine import AsyncLLMEngine  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

APP = "tpserve-tools-test"
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                  "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA,
                                           "description": "The forecast for a city."}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris this week?"}]
MODEL, API_KEY, BLOCK_SIZE = "tiny-tools", "tools-key", 16
GREEDY = dict(model=MODEL, temperature=0, max_tokens=120)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100)
class OneEngineGroup:
    def __init__(self, model_dir: str) -> None:
        self.engine = AsyncLLMEngine(lambda: LLMEngine(EngineConfig(
            model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=256)))

    async def generate(self, request: GroupRequest, num_tokens: int = 0, block_hashes=()):
        async for chunk in stream_chunks(self.engine, request):
            yield chunk


@pytest.fixture(scope="module")
def grpc_port():
    return free_port()


@pytest.fixture(scope="module")
def client(tool_checkpoints, grpc_port):
    model_dir = str(tool_checkpoints("qwen2"))
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # replicas cannot import this test module
    port = free_port()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    grpc_options=grpc_options(grpc_port))
        app = build_ingress(OneEngineGroup.bind(model_dir), model_dir, MODEL, BLOCK_SIZE,
                            MAX_MODEL_LEN, ApiKey((API_KEY,)), max_migrations=0)
        serve.run(app, name=APP, route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                            max_retries=0, timeout=60)
    finally:
        stop_local_ray()
        cloudpickle.unregister_pickle_by_value(module)


def check_call(name, arguments, expected=None):
    assert name in SCHEMAS and (expected is None or name == expected), name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def answer_messages(call_id, name, arguments):
    """The history after the call: the assistant's call and the tool's result."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"forecast": "sunny"}'}]


def test_a_round_trip_not_streamed(client):
    response = client.chat.completions.create(messages=QUESTION, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=False,
                                              **GREEDY)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)
    # The SDK's message object goes back into the history as it is (docs/api.md's example).
    history = QUESTION + [choice.message, {"role": "tool", "tool_call_id": call.id,
                                           "content": '{"forecast": "sunny"}'}]
    final = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none",
                                           **{**GREEDY, "max_tokens": 8})
    message = final.choices[0].message
    assert final.choices[0].finish_reason in ("stop", "length")
    assert isinstance(message.content, str) and not message.tool_calls


def streamed(stream):
    """The content, the calls (index -> [id, name, arguments]) and the finish reason of a
    streamed choice, checking OpenAI's order: a call's first part has its id and name."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                if part.index not in calls:
                    assert part.id and part.function.name and part.type == "function"
                    calls[part.index] = [part.id, part.function.name, ""]
                else:
                    assert part.id is None and part.function.name is None
                calls[part.index][2] += part.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_a_round_trip_streamed(client):
    stream = client.chat.completions.create(messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            stream=True, **GREEDY)
    content, calls, reasons = streamed(stream)
    assert reasons == ["tool_calls"] and content == "" and list(calls) == [0]
    call_id, name, arguments = calls[0]
    check_call(name, arguments)
    stream = client.chat.completions.create(
        messages=answer_messages(call_id, name, arguments), tools=TOOLS, tool_choice="none",
        stream=True, **{**GREEDY, "max_tokens": 8})
    content, calls, reasons = streamed(stream)
    assert reasons[0] in ("stop", "length") and not calls


def test_streamed_and_not_streamed_calls_agree(client):
    request = dict(messages=QUESTION, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False, **GREEDY)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls
    _, calls, _ = streamed(client.chat.completions.create(stream=True, **request))
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        (name, arguments) for _, name, arguments in calls.values()]


def test_each_of_n_choices_has_its_own_calls(client):
    response = client.chat.completions.create(
        messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
        seed=7, **{**GREEDY, "temperature": 1.0})
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        [call] = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments)
        assert choice.finish_reason == "tool_calls"


def test_a_named_tool_choice_calls_that_function(client):
    for name in ("ping", "get_weather"):
        response = client.chat.completions.create(
            messages=QUESTION, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}}, **GREEDY)
        [call] = response.choices[0].message.tool_calls
        check_call(call.function.name, call.function.arguments, expected=name)
        assert response.choices[0].finish_reason == "tool_calls"


def test_an_unknown_named_tool_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            messages=QUESTION, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
    assert info.value.body["param"] == "tool_choice" and "get_time" in info.value.message


def test_a_tool_schema_that_cannot_compile_is_a_400_naming_tools(client):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=QUESTION, tools=bad, tool_choice="required",
                                       **GREEDY)
    assert info.value.body["param"] == "tools", info.value.body  # refused before routing


def test_grpc_tool_calls_equal_the_http_apis(client, grpc_port):
    grpc = pytest.importorskip("grpc")
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb
    from cluster.proto.tpserve.v1 import tpserve_pb2_grpc as pb_grpc

    http = client.chat.completions.create(
        messages=QUESTION, tools=TOOLS, tool_choice={"type": "function",
                                                     "function": {"name": "get_weather"}},
        **GREEDY).choices[0].message.tool_calls[0]
    tools = [pb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                     parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    request = pb.ChatRequest(model=MODEL, messages=[pb.ChatMessage(**QUESTION[0])], tools=tools,
                             tool_choice=pb.ToolChoice(function="get_weather"),
                             max_tokens=GREEDY["max_tokens"], temperature=0)
    auth = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.TPServeStub(channel)
        whole = stub.Chat(request, metadata=auth, timeout=60)
        chunks = list(stub.ChatStream(request, metadata=auth, timeout=60))
        with pytest.raises(grpc.RpcError) as info:
            stub.Chat(pb.ChatRequest(model=MODEL, messages=request.messages, tools=tools,
                                     tool_choice=pb.ToolChoice(function="nope")),
                      metadata=auth, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_choice" in info.value.details()
    [call] = whole.tool_calls
    assert (call.name, call.arguments) == (http.function.name, http.function.arguments)
    assert whole.finish_reason == "tool_calls" and whole.text == ""
    parts = [d for c in chunks for d in c.tool_calls]
    assert parts[0].name == "get_weather" and parts[0].id.startswith("call_")
    assert "".join(d.arguments for d in parts) == http.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
