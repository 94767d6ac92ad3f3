"""The whole product on Ray: `build_app` (ingress + KV-aware router + a TP 2 group whose rank 1 is
a Ray actor), driven with the official `openai` client and a `grpcio` client; greedy outputs equal
transformers'."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.app import ServeConfig, build_app  # noqa: E402
from cluster.api.grpc_service import grpc_options  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

API_KEY = "e2e-key"
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 131))]
MAX_NEW = 10



def serve_app(model_dir, port, engine_kwargs=None, grpc_port=0, **config):
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options=grpc_options(grpc_port))
    engine = EngineConfig(model=str(model_dir), tp_size=2, block_size=4, num_kv_blocks=128,
                          **{"dtype": "float32", **(engine_kwargs or {})})
    # One ingress replica unless a test asks for more: the default (two) is served in
    # tests/deploy/test_deploy_serve_run.py, and each replica costs a process here.
    config.setdefault("ingress_replicas", "1")
    app = build_app(ServeConfig(engine=engine, api_key=API_KEY, served_model_name="tiny",
                                **config), ray.cluster_resources())
    serve.run(app, name="tpserve", route_prefix="/")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)


@contextlib.contextmanager
def local_serving(model_dir, grpc_port=0, **engine_kwargs):
    """The app on a fresh local Ray (gRPC too unless ``grpc_port`` is 0); yields an `openai`
    client; stops everything after."""
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False)
    try:
        yield serve_app(model_dir, free_port(), engine_kwargs, grpc_port)
    finally:
        stop_local_ray()


@pytest.fixture(scope="module")
def grpc_port():
    return free_port()


@pytest.fixture(scope="module")
def client(tiny_llama, grpc_port):
    with local_serving(tiny_llama, grpc_port) as openai_client:
        yield openai_client


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


def test_greedy_completions_equal_transformers(client, tiny_llama, expected):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    for prompt, want in zip(PROMPTS, expected):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW,
                                        temperature=0.0)
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.completion_tokens == len(want)
        assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)


def test_a_batch_of_prompts_through_the_kv_aware_router_equals_transformers(client, tiny_llama,
                                                                          expected):
    # Each prompt is routed as a Serve call of its own. Before, the calls shared the HTTP
    # request's Serve id, and the second prompt was never routed: the request hung.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    out = client.with_options(timeout=60, max_retries=0).completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=MAX_NEW, temperature=0.0)
    assert [c.text for c in out.choices] == [tokenizer.decode(want, skip_special_tokens=True)
                                             for want in expected]
    assert out.usage.completion_tokens == sum(map(len, expected))


def test_text_prompt_chat_and_streaming(client):
    text = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=4,
                                     temperature=0.0)
    assert text.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0.0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0.0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content


def test_bad_request_and_wrong_key(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-3)
    wrong = client.with_options(api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_group_ranks_share_one_node_by_default(client):
    handle = serve.get_deployment_handle("TPGroup", app_name="tpserve")
    ranks = handle.rank_info.remote().result()
    assert len(ranks) == 2 and ranks[0]["node"] == ranks[1]["node"]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    # CPU binding (parallel/cpu_binding.py): each rank claims the next core while one is left
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        assert ranks[0]["cpus"] == [cpus[0]]
        assert ranks[1]["cpus"] == ([cpus[1]] if len(cpus) >= 3 else cpus)


def test_health_reports_the_serving_groups_and_n_choices_on_a_tp2_group(client, expected):
    url = str(client.base_url).replace("/v1/", "/health").rstrip("/")
    deadline = time.monotonic() + 30  # the group pushes its report every second
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
                break
        except urllib.error.HTTPError as err:
            assert err.code == 503 and time.monotonic() < deadline
            time.sleep(0.5)
    assert body == {"status": "ok", "groups": 1}
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_NEW,
                                    temperature=0.0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text
    assert out.usage.completion_tokens == 2 * len(expected[0])


def test_status_json_against_the_local_serve(client):
    """`tpserve status --json` as a user runs it, against this local serve (Serve places the
    group: no plan on a CPU-only machine)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    address = ray.get_runtime_context().gcs_address
    deadline = time.monotonic() + 30
    # The group describes its ranks with its first metrics push (every second), and a push
    # taken during the previous test's last request still counts it running: wait for an idle
    # report.
    while True:
        done = subprocess.run([sys.executable, "-m", "cluster.cli.main", "status", "--address",
                               address, "--json"], cwd=repo, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "RAY_AUTH_MODE": "token",
                                                "PYTHONPATH": str(repo)})
        assert done.returncode == 0, done.stderr[-2000:]
        data = json.loads(done.stdout)
        idle = data["groups"] and data["groups"][0]["ranks"] and \
            data["groups"][0]["running"] == 0 and data["groups"][0]["waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert data["placement"] == "serve" and data["plan"] is None
    (group,) = data["groups"]
    handle = serve.get_deployment_handle("TPGroup", app_name="tpserve")
    ranks = handle.rank_info.remote().result()
    assert [(r["node"], r["pid"]) for r in group["ranks"]] == [(r["node"], r["pid"])
                                                               for r in ranks]
    assert 0.0 <= group["kv_usage"] <= 1.0 and group["running"] == 0 and group["waiting"] == 0
    assert data["deployment"]["status"] == "HEALTHY" and data["errors"] == []


def test_grpc_on_the_whole_app_equals_transformers_and_http(client, grpc_port, expected):
    grpc = pytest.importorskip("grpc")
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb
    from cluster.proto.tpserve.v1 import tpserve_pb2_grpc as pb_grpc

    auth = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.TPServeStub(channel)
        for prompt, want in zip(PROMPTS, expected):
            out = stub.Complete(pb.CompletionRequest(model="tiny", prompt_token_ids=prompt,
                                                     max_tokens=MAX_NEW, temperature=0),
                                metadata=auth, timeout=120)
            assert list(out.token_ids) == want and out.usage.prompt_tokens == len(prompt)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            temperature=0.0)
        chunks = list(stub.ChatStream(pb.ChatRequest(
            model="tiny", messages=[pb.ChatMessage(role="user", content="hello")],
            max_tokens=4, temperature=0), metadata=auth, timeout=120))
        assert "".join(c.text for c in chunks) == chat.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


# ----- structured outputs (issue 40): the OpenAI SDK's parse, vLLM's fields, gRPC -----

def _answer_model():
    from enum import Enum
    from typing import Literal

    from pydantic import BaseModel, conint, constr

    class Mood(str, Enum):
        happy = "happy"
        sad = "sad"

    class Answer(BaseModel):  # bounded: a random model completes it in a few dozen tokens
        mood: Mood
        sure: bool
        score: conint(ge=0, le=9)
        word: constr(max_length=4)
        kind: Literal["a", "b"]

    return Answer


def test_chat_completions_parse_returns_the_pydantic_object(client):
    import re

    import jsonschema

    answer = _answer_model()
    out = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "how are you?"}],
        response_format=answer, max_tokens=120, temperature=0.0,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, answer), message.content
    jsonschema.validate(json.loads(message.content), answer.model_json_schema())
    # disable_any_whitespace: outside strings, only the canonical ", " and ": " separators
    names = iter(range(100))
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', lambda _: f'"{next(names)}"', message.content)
    assert skeleton == json.dumps(json.loads(skeleton)), message.content


def test_regex_and_choice_outputs_match(client):
    import re

    regex = r"[a-c]{3}-\d{2}"
    out = client.completions.create(model="tiny", prompt="code:", max_tokens=20,
                                    temperature=0.0, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    choices = ["red", "green", "blue"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a colour?"}], max_tokens=20,
        temperature=1.0, seed=3, n=2, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in chat.choices), chat.choices


def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=8, response_format=bad)
    assert info.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body={
            "guided_json": {"$ref": "#/$defs/Missing"}})
    assert info.value.body["param"] == "guided_json" and "$defs" in info.value.message


def test_grpc_structured_output(grpc_port):
    grpc = pytest.importorskip("grpc")
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb
    from cluster.proto.tpserve.v1 import tpserve_pb2_grpc as pb_grpc

    auth = (("authorization", f"Bearer {API_KEY}"),)
    choices = pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"]))
    bad = pb.StructuredOutput(regex="(ab")
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.TPServeStub(channel)
        out = stub.Chat(pb.ChatRequest(model="tiny", messages=[pb.ChatMessage(
            role="user", content="ok?")], max_tokens=8, structured_output=choices),
            metadata=auth, timeout=120)
        assert out.text in ("yes", "no") and out.finish_reason == "stop", out
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(pb.CompletionRequest(model="tiny", prompt="x", max_tokens=4,
                                               structured_output=bad), metadata=auth, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("structured_output.regex: invalid regex")
