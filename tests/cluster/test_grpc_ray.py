"""The gRPC API (``tpserve.v1.TPServe``) through Ray Serve's gRPC proxy on a real local Ray,
called with a ``grpcio`` client, beside the HTTP API of the same ingress.

The group is ``ingress_app``'s (the ingress tests'): the real ``AsyncLLMEngine`` over a tiny checkpoint, streamed
with the group deployment's own ``stream_chunks``, with slow steps and failures on demand. Here it
takes at most 2 requests at once and queues 2 more, so a burst overloads it, and the ingress
migrates no request (``max_migrations=0``), so a group that fails mid-request fails the call.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
from ray import cloudpickle, serve  # noqa: E402

import ingress_app  # noqa: E402
from cluster.api.grpc_service import grpc_options  # noqa: E402
from cluster.api.api_key import ApiKey  # noqa: E402
from cluster.api.ingress import build_ingress  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from cluster.proto.tpserve.v1 import tpserve_pb2 as pb  # noqa: E402
from cluster.proto.tpserve.v1 import tpserve_pb2_grpc as pb_grpc  # noqa: E402
from ingress_app import BLOCK_SIZE, TinyGroup, group, tokenizer  # noqa: E402,F401 (fixtures)
from tiny_models import hf_greedy  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

API_KEY = "grpc-key"
MODEL = "tiny"
APP = "tpserve-grpc-test"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
MAX_ONGOING, MAX_QUEUED = 2, 2


@pytest.fixture(scope="module")
def server(tiny_llama):
    cloudpickle.register_pickle_by_value(ingress_app)
    http_port, grpc_port = free_port(), free_port()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=grpc_options(grpc_port))
        group = TinyGroup.options(max_ongoing_requests=MAX_ONGOING,
                                  max_queued_requests=MAX_QUEUED)
        app = build_ingress(group.bind(str(tiny_llama)), str(tiny_llama), MODEL, BLOCK_SIZE,
                            256, ApiKey((API_KEY,)), max_migrations=0)
        serve.run(app, name=APP, route_prefix="/")
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        yield {"url": f"http://127.0.0.1:{http_port}", "stub": pb_grpc.TPServeStub(channel),
               "group": serve.get_deployment_handle("TinyGroup", app_name=APP),
               "model_dir": tiny_llama}
        channel.close()
    finally:
        stop_local_ray()


@pytest.fixture(scope="module")
def stub(server):
    return server["stub"]


def http(server, path, body=None, key=API_KEY):
    """(status, decoded JSON or text) of an HTTP call to the same ingress."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server["url"] + path, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    return status, (json.loads(raw) if path.startswith("/v1") else raw.decode())


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, timeout=60, **kwargs)
        if hasattr(result, "__next__"):  # a stream: the error comes as it is read
            list(result)
    return info.value


def test_list_models_and_the_api_key(stub):
    assert list(stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=30).models) \
        == [MODEL]
    request = pb.CompletionRequest(model=MODEL, prompt="hi", max_tokens=2)
    chat = pb.ChatRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content="hi")])
    for call, req in [(stub.ListModels, pb.ListModelsRequest()), (stub.Complete, request),
                      (stub.CompleteStream, request), (stub.Chat, chat),
                      (stub.ChatStream, chat)]:
        for metadata in ((), (("authorization", "Bearer nope"),),
                         (("authorization", API_KEY),)):
            error = rpc_error(call, req, metadata=metadata)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (call, metadata)
            assert "API key" in error.details()


def complete(stub, **fields) -> pb.CompletionResponse:
    return stub.Complete(pb.CompletionRequest(model=MODEL, **fields), metadata=AUTH, timeout=60)


def stream(call, request) -> list:
    return list(call(request, metadata=AUTH, timeout=60))


def test_greedy_complete_returns_the_http_apis_tokens(server, stub, tokenizer):
    ids = [5, 6, 7, 8, 9]
    [expected] = hf_greedy(server["model_dir"], [ids], 8)
    out = complete(stub, prompt_token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
    status, body = http(server, "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert status == 200 and list(out.token_ids) == expected
    choice = body["choices"][0]
    assert out.text == choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert [tokenizer.decode([t]) for t in out.token_ids] == choice["logprobs"]["tokens"]
    assert out.finish_reason == choice["finish_reason"] == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 8)
    assert out.id.startswith("cmpl-")

    text = complete(stub, prompt="hello world", max_tokens=6, temperature=0)
    status, body = http(server, "/v1/completions", {"model": MODEL, "prompt": "hello world",
                                                    "max_tokens": 6, "temperature": 0})
    assert text.text == body["choices"][0]["text"]
    assert text.usage.prompt_tokens == body["usage"]["prompt_tokens"] == \
        len(tokenizer.encode("hello world"))
    unset = complete(stub, prompt="hello world", temperature=0)  # max_tokens 0: HTTP's 16
    assert unset.usage.completion_tokens == len(unset.token_ids) <= 16


def test_the_concatenated_stream_equals_the_unary_completion(stub):
    request = pb.CompletionRequest(model=MODEL, prompt_token_ids=[5, 6, 7], max_tokens=10,
                                   temperature=0, ignore_eos=True)
    whole = stub.Complete(request, metadata=AUTH, timeout=60)
    chunks = stream(stub.CompleteStream, request)
    assert len(chunks) > 1 and "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]
    assert not any(c.HasField("usage") for c in chunks[:-1])
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 10)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id


def test_chat_uses_the_chat_template_like_http(server, stub, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = pb.ChatRequest(model=MODEL, messages=[pb.ChatMessage(**m) for m in messages],
                             max_tokens=6, temperature=0, ignore_eos=True)
    out = stub.Chat(request, metadata=AUTH, timeout=60)
    status, body = http(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out.usage.prompt_tokens == body["usage"]["prompt_tokens"] == len(prompt["input_ids"])
    assert out.text == body["choices"][0]["message"]["content"]
    assert out.id.startswith("chatcmpl-") and out.usage.completion_tokens == 6
    chunks = stream(stub.ChatStream, request)
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == list(out.token_ids)
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6


def test_sampling_fields_reach_the_group_as_over_http(server, stub, group):
    out = complete(stub, prompt_token_ids=list(range(10, 23)), max_tokens=7, temperature=0.8,
                   top_p=0.9, top_k=20, seed=1, stop=["zz"], stop_token_ids=[3], min_p=0.05,
                   repetition_penalty=1.2, min_tokens=2)
    calls = group.state.remote().result()["calls"]
    sampling = next(c for c in calls if c["request_id"] == out.id)["request"].sampling
    assert sampling == SamplingParams(
        max_tokens=7, temperature=0.8, top_p=0.9, top_k=20, seed=1, stop=("zz",),
        stop_token_ids=(3,), min_p=0.05, min_tokens=2, repetition_penalty=1.2)
    default = complete(stub, prompt="hi", max_tokens=2)
    sampling = next(c for c in group.state.remote().result()["calls"]
                    if c["request_id"] == default.id)["request"].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, None)


# (gRPC request fields, the same request over HTTP)
BAD_REQUESTS = [
    (dict(prompt="hello", max_tokens=10_000), dict(prompt="hello", max_tokens=10_000)),
    (dict(prompt="hello", temperature=-1.0), dict(prompt="hello", temperature=-1.0)),
    (dict(prompt="hello", top_p=0.0), dict(prompt="hello", top_p=0.0)),
    (dict(prompt="hello", max_tokens=4, min_tokens=5),
     dict(prompt="hello", max_tokens=4, min_tokens=5)),
    (dict(prompt_token_ids=[1] * 256), dict(prompt=[1] * 256)),
    (dict(prompt_token_ids=[1, 100_000]), dict(prompt=[1, 100_000])),
    (dict(), dict(prompt="")),
]


@pytest.mark.parametrize("fields,body", BAD_REQUESTS)
def test_bad_input_is_invalid_argument_with_the_http_message(server, stub, fields, body):
    status, http_body = http(server, "/v1/completions", {"model": MODEL, **body})
    assert status == 400
    for call in (stub.Complete, stub.CompleteStream):
        error = rpc_error(call, pb.CompletionRequest(model=MODEL, **fields), metadata=AUTH)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == http_body["error"]["message"]


def test_bad_chat_input_and_an_unknown_model(server, stub):
    bad_role = [pb.ChatMessage(role="robot", content="hi")]
    status, body = http(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "robot", "content": "hi"}]})
    for call in (stub.Chat, stub.ChatStream):
        error = rpc_error(call, pb.ChatRequest(model=MODEL, messages=bad_role), metadata=AUTH)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert status == 400 and error.details() == body["error"]["message"]
        error = rpc_error(call, pb.ChatRequest(model=MODEL), metadata=AUTH)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in error.details()
    both = pb.CompletionRequest(model=MODEL, prompt="a", prompt_token_ids=[5])
    assert rpc_error(stub.Complete, both, metadata=AUTH).code() == \
        grpc.StatusCode.INVALID_ARGUMENT
    status, body = http(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    for call, request in [
            (stub.Complete, pb.CompletionRequest(model="gpt-4", prompt="hi")),
            (stub.ChatStream, pb.ChatRequest(model="gpt-4", messages=[
                pb.ChatMessage(role="user", content="hi")]))]:
        error = rpc_error(call, request, metadata=AUTH)
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert status == 404 and error.details() == body["error"]["message"]


def test_a_failed_group_is_unavailable_and_a_bug_is_internal_without_details(stub, group):
    request = pb.CompletionRequest(model=MODEL, prompt="hi", max_tokens=20, ignore_eos=True)
    group.configure.remote(failure="during").result()  # the engine dies after a first chunk
    error = rpc_error(stub.Complete, request, metadata=AUTH)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "TP group serving this request failed" in error.details()
    assert "collective" not in error.details()  # the engine's own words stay in the log
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for chunk in stub.CompleteStream(request, metadata=AUTH, timeout=60):
            received.append(chunk)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and len(received) == 1
    group.configure.remote(failure="bug").result()
    for call in (stub.Complete, stub.CompleteStream):
        error = rpc_error(call, request, metadata=AUTH)
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == "internal server error"


def test_a_burst_past_the_groups_queue_is_resource_exhausted(stub, group):
    group.configure.remote(step_delay_s=0.05).result()
    request = pb.CompletionRequest(model=MODEL, prompt_token_ids=[5, 6, 7], max_tokens=20,
                                   ignore_eos=True)

    def one(_):
        try:
            return stub.Complete(request, metadata=AUTH, timeout=60).usage.completion_tokens
        except grpc.RpcError as error:
            return error.code(), error.details()

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(one, range(10)))
    served = [o for o in outcomes if o == 20]
    refused = [o for o in outcomes if o != 20]
    assert len(served) >= MAX_ONGOING + MAX_QUEUED and refused, outcomes
    assert all(o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "every TP group is busy" in o[1]
               for o in refused), outcomes


def test_cancelling_a_stream_aborts_the_request_in_the_engine(server, stub, group):
    # 200 tokens take 30 s: a cancellation that is slow on a loaded host still lands first.
    group.configure.remote(step_delay_s=0.15).result()
    request = pb.CompletionRequest(model=MODEL, prompt_token_ids=[5, 6, 7], max_tokens=200,
                                   ignore_eos=True)
    call = stub.CompleteStream(request, metadata=AUTH, timeout=60)
    rid = next(call).id
    next(call)  # the stream is flowing through the proxy before the client cancels
    call.cancel()
    deadline = time.monotonic() + 30  # generous: other jobs load this 2-core host
    state = group.state.remote().result()
    while time.monotonic() < deadline and not (rid in state["cancelled"]
                                               and state["num_running"] == 0
                                               and state["kv_blocks_used"] == 0):
        time.sleep(0.2)
        state = group.state.remote().result()
    summary = {k: state[k] for k in ("cancelled", "num_running", "kv_blocks_used")}
    assert rid in state["cancelled"], summary
    assert state["num_running"] == 0 and state["kv_blocks_used"] == 0, summary
    assert state["num_chunks"][rid] < 100  # stopped well before its 200 tokens
    status, metrics = http(server, "/metrics")
    assert 'tpserve:grpc_requests_total{code="CANCELLED",method="CompleteStream",' \
           'model_name="tiny"}' in metrics
    assert 'tpserve:request_success_total{finished_reason="abort",model_name="tiny"}' in metrics


def test_grpc_calls_are_counted_by_method_and_code(server, stub):
    from prometheus_client.parser import text_string_to_metric_families

    complete(stub, prompt="hi", max_tokens=2)
    rpc_error(stub.Complete, pb.CompletionRequest(model=MODEL, prompt="hi", temperature=-1),
              metadata=AUTH)
    samples = {tuple(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(http(server, "/metrics")[1])
               if f.name == "tpserve:grpc_requests" for s in f.samples
               if s.name.endswith("_total")}
    label = (("model_name", MODEL),)
    assert samples[(("code", "OK"), ("method", "Complete")) + label] >= 1
    assert samples[(("code", "INVALID_ARGUMENT"), ("method", "Complete")) + label] >= 1
    assert samples[(("code", "UNAUTHENTICATED"), ("method", "ListModels")) + label] >= 1
