"""The ingress on a real local Ray Serve, driven by the official `openai` client.

A group-like deployment runs the real `AsyncLLMEngine` over a tiny checkpoint (TP 1, in the
replica) and streams with `cluster.groups.stream.stream_chunks`, the code the TP group deployment
uses; it can slow its steps (to disconnect mid-stream) and fail on demand (to see the errors).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import cloudpickle, serve  # noqa: E402

from cluster.contract import GroupRequest  # noqa: E402
from cluster.groups.stream import stream_chunks  # noqa: E402
from cluster.api.ingress import HEALTH_MAX_REPORT_AGE_S, build_ingress  # noqa: E402
from cluster.metrics import get_metrics_store  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from cluster.api.request_limits import IngressLimits  # noqa: E402
from kv.prefix_hash import extend_block_hashes  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402
from workers.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.tokenizer import load_tokenizer  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

API_KEY = "test-key"
MODEL = "tiny"
BLOCK_SIZE = 4
APP = "tpserve-ingress-test"


class SlowableEngine(LLMEngine):
    """Sleeps before each step when asked, so a stream lasts long enough to walk away from."""

    step_delay_s = 0.0

    def step(self):
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return super().step()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100)
class TinyGroup:
    def __init__(self, model_dir: str) -> None:
        self.engine = AsyncLLMEngine(lambda: SlowableEngine(EngineConfig(
            model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=128)))
        self.calls: list = []
        self.cancelled: list = []
        self.num_chunks: dict = {}
        self.failure = None

    async def generate(self, request: GroupRequest, num_tokens: int = 0, block_hashes=()):
        rid = request.request_id
        self.calls.append({"request_id": rid, "num_tokens": num_tokens,
                           "block_hashes": list(block_hashes), "request": request})
        if self.failure == "before":
            raise EngineDeadError("engine failed: rank 1 died")
        if self.failure == "bug":
            raise RuntimeError("secret internal detail")
        try:
            async for chunk in stream_chunks(self.engine, request):
                self.num_chunks[rid] = self.num_chunks.get(rid, 0) + 1
                yield chunk
                if self.failure == "during":
                    raise EngineDeadError("engine failed: collective timed out")
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(rid)
            raise

    def configure(self, step_delay_s: float = 0.0, failure=None) -> None:
        """``failure``: "before" or "during" the stream (the engine died), "bug" (a defect)."""
        self.engine.engine.step_delay_s = step_delay_s
        self.failure = failure

    def state(self) -> dict:
        sched = self.engine.engine.scheduler
        return {"calls": self.calls, "cancelled": self.cancelled, "num_chunks": self.num_chunks,
                "num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_blocks_used": self.engine.load.kv.num_used_blocks}

    def push_metrics(self) -> None:
        load = self.engine.load
        ray.get(get_metrics_store().push.remote("tiny-group-0", {
            "engine_alive": 1.0 if self.engine.is_alive else 0.0, "kv_usage_frac": load.kv.usage, "kv_blocks_used": load.kv.num_used_blocks,
            "kv_blocks_total": load.kv.num_blocks, "tokens_in_flight": load.kv.num_filled_slots,
            "num_requests_running": load.num_running, "num_requests_waiting": load.num_waiting,
            "prefix_cache_queries_total": 10, "prefix_cache_hits_total": 4,
            "num_preemptions_total": 0, "allreduce_latency_seconds": [0.001, 0.002],
        }))



@pytest.fixture(scope="module")
def server(tiny_llama):
    # Replicas cannot import this test module: ship the classes defined here by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    port = free_port()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # No migration: the stand-in group fails on demand, and the error it maps to is tested
        # here (migration is tested against real groups in test_serve_failover).
        app = build_ingress(TinyGroup.bind(str(tiny_llama)), str(tiny_llama), MODEL,
                            BLOCK_SIZE, 256, API_KEY, max_migrations=0)
        serve.run(app, name=APP, route_prefix="/")
        group = serve.get_deployment_handle("TinyGroup", app_name=APP)
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "group": group,
               "model_dir": tiny_llama}
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture
def group(server):
    group = server["group"]
    yield group
    group.configure.remote().result()


def call(server, method, path, body=None, key=API_KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(server["url"] + path, data=data, headers=headers,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_and_health(server, client, group):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = call(server, "GET", "/health", key=None)  # no group has reported yet
    assert status == 503 and json.loads(body)["error"]["code"] == "no_healthy_group"
    group.push_metrics.remote().result()
    assert call(server, "GET", "/health", key=None) == (200, b'{"status":"ok","groups":1}')
    time.sleep(HEALTH_MAX_REPORT_AGE_S + 0.5)  # a group that stops reporting is gone
    assert call(server, "GET", "/health", key=None)[0] == 503


def test_completions_text_and_token_ids_equal_transformers(client, server, tokenizer):
    ids = [5, 6, 7, 8, 9]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    [expected] = hf_greedy(server["model_dir"], [ids], 6)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 6)

    text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=4, **GREEDY)
    assert text.usage.prompt_tokens == len(tokenizer.encode("hello world"))
    assert text.usage.total_tokens == text.usage.prompt_tokens + 4
    one = client.completions.create(model=str(server["model_dir"]), prompt=["hello world"],
                                    max_tokens=4, **GREEDY)
    assert one.choices[0].text == text.choices[0].text and one.model == MODEL


def test_chat_uses_the_checkpoint_template(client, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages,
                                         max_completion_tokens=5, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out.usage.prompt_tokens == len(prompt["input_ids"])
    assert out.usage.completion_tokens == 5


def test_streaming_completions_and_chat(client):
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           **GREEDY)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 stream=True, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in stream)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == whole.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_sse_ends_with_done(server):
    status, body = call(server, "POST", "/v1/completions", {
        "model": MODEL, "prompt": [5, 6], "max_tokens": 3, "stream": True})
    events = [line for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=2,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs) and "".join(lp.tokens) == \
        out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "hi"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_the_group_gets_the_token_count_and_block_hashes(client, group):
    ids = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=7, seed=1,
                                    temperature=0.8, top_p=0.9, stop=["zz"],
                                    extra_body={"top_k": 20})
    call = next(c for c in group.state.remote().result()["calls"]
                if c["request_id"] == out.id)
    assert call["num_tokens"] == 13 + 7
    assert call["block_hashes"] == extend_block_hashes([], ids, BLOCK_SIZE)
    assert call["request"].sampling == SamplingParams(
        max_tokens=7, temperature=0.8, top_p=0.9, top_k=20, seed=1, stop=("zz",))
    assert call["request"].prompt_token_ids == tuple(ids)


@pytest.mark.parametrize("kwargs,words", [
    (dict(max_tokens=10_000), "max_tokens can be at most"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=-5), "max_tokens must be at least 1"),
    (dict(prompt=[1] * 256), "the prompt has 256 tokens"),
    (dict(temperature=-1.0), "temperature must be in"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(n=100), "n must be an integer in [1, 64]"),
    (dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens must be"),
    (dict(logit_bias={"100000": 1}), "logit_bias token ids must be in [0, 509)"),
    (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
    (dict(extra_body={"guided_json": {}}), "guided_json is not supported"),
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[1, 100_000]), "prompt token ids must be in [0, 509)"),
    (dict(echo=True, logprobs=1), "echo with logprobs is not supported"),
])
def test_bad_requests_get_400_with_a_message(client, kwargs, words):
    request = dict(model=MODEL, prompt="hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    assert info.value.status_code == 400 and words in info.value.message, info.value.message
    assert info.value.body["message"] and "type" in info.value.body


def test_unknown_model_and_bad_json(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user",
                                                                 "content": "hi"}])
    status, body = call(server, "POST", "/v1/chat/completions", b'{"model": "tiny", ')
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = call(server, "POST", "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "max_completion_tokens": 999})
    assert status == 400 and json.loads(body)["error"]["param"] == "max_completion_tokens"
    status, body = call(server, "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_api_key(server):
    wrong = openai.OpenAI(base_url=server["url"] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert call(server, "GET", "/v1/models", key=None)[0] == 401
    assert call(server, "GET", "/health", key=None)[0] in (200, 503)  # no key needed
    assert call(server, "GET", "/metrics", key=None)[0] == 200


def test_group_failure_is_a_5xx_or_an_error_event(client, group):
    group.configure.remote(failure="before").result()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert info.value.status_code == 503 and info.value.body["code"] == "group_failed"
    assert "rank 1" not in info.value.message  # internals stay in the log
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "hi"}],
                                       max_tokens=4, stream=True)
    group.configure.remote(failure="during").result()
    with pytest.raises(openai.APIError, match="TP group serving this request failed"):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True,
                                       **GREEDY))
    group.configure.remote(failure="bug").result()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert info.value.status_code == 500 and info.value.body["message"] == "internal server error"
    assert "secret" not in json.dumps(info.value.body)


def test_disconnect_aborts_the_request_in_the_engine(server, group):
    group.configure.remote(step_delay_s=0.05).result()
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True,
        "ignore_eos": True}), {"Authorization": f"Bearer {API_KEY}",
                               "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = json.loads(resp.readline().decode()[len("data: "):])
    resp.close()
    conn.close()
    rid = first["id"]
    deadline = time.monotonic() + 15
    state = group.state.remote().result()
    while time.monotonic() < deadline and not (rid in state["cancelled"]
                                               and state["num_running"] == 0):
        time.sleep(0.2)
        state = group.state.remote().result()
    assert rid in state["cancelled"]
    assert state["num_running"] == 0 and state["kv_blocks_used"] == 0
    assert state["num_chunks"][rid] < 100  # stopped well before its 200 tokens
    metrics = call(server, "GET", "/metrics")[1].decode()
    assert 'tpserve:request_success_total{finished_reason="abort",model_name="tiny"}' in metrics


def test_concurrent_requests(client):
    def one(i):
        return client.completions.create(model=MODEL, prompt=[5 + i, 6, 7], max_tokens=5 + i,
                                         **GREEDY)

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(4)))
    assert [o.usage.completion_tokens for o in outs] == [5, 6, 7, 8]
    assert len({o.id for o in outs}) == 4


def test_metrics_endpoint(server, client, group):
    client.completions.create(model=MODEL, prompt="hello", max_tokens=3, **GREEDY)
    group.push_metrics.remote().result()
    status, body = call(server, "GET", "/metrics", key=None)
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    group_labels = (("group", "tiny-group-0"), ("model_name", MODEL))
    assert samples[("tpserve:num_kv_blocks", group_labels)] == 128
    assert 0 <= samples[("tpserve:kv_cache_usage_perc", group_labels)] <= 1
    assert samples[("tpserve:prefix_cache_hits_total", group_labels)] == 4
    assert samples[("tpserve:allreduce_latency_seconds_count", group_labels)] >= 2
    for name in ("tpserve:num_requests_running", "tpserve:num_requests_waiting",
                 "tpserve:tokens_in_flight", "tpserve:prefix_cache_queries",
                 "tpserve:router_decisions", "tpserve:e2e_request_latency_seconds",
                 "tpserve:request_prompt_tokens", "tpserve:request_generation_tokens"):
        assert name in families, name
    model = (("model_name", MODEL),)
    assert samples[("tpserve:time_to_first_token_seconds_count", model)] >= 1
    assert samples[("tpserve:inter_token_latency_seconds_count", model)] >= 2
    assert samples[("tpserve:request_success_total",
                    (("finished_reason", "length"), ("model_name", MODEL)))] >= 1


def test_ray_metrics_export(server, client, group):
    """The same numbers reach Ray's own export (``ray_`` prefix, ``_`` for ``:``)."""
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2, **GREEDY)
    group.push_metrics.remote().result()
    port = ray._private.worker.global_worker.node.metrics_export_port
    wanted = ("ray_tpserve_time_to_first_token_seconds_count", "ray_tpserve_kv_cache_usage_perc",
              "ray_tpserve_request_success_total")
    deadline, found = time.monotonic() + 30, set()
    while time.monotonic() < deadline and len(found) < len(wanted):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        found = {name for name in wanted if f"\n{name}{{" in text}
        time.sleep(0.5)
    assert found == set(wanted)


# ----- what a vLLM user expects (issue 14) -----

def test_n_choices_equal_transformers_and_stream_by_index(client, server):
    ids = [5, 6, 7, 8, 9]
    [expected] = hf_greedy(server["model_dir"], [ids], 5)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, n=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 1 and out.usage.completion_tokens == 15
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        temperature=1.0, seed=7)
    assert [c.index for c in chat.choices] == [0, 1]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
            temperature=1.0, seed=7, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in chat.choices]  # same seeds
    assert expected  # the greedy reference ran


def test_echo_and_sampling_parameters_through_the_openai_client(client, tokenizer):
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3,
                                    echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3, **GREEDY)
    assert out.choices[0].text == "hello world" + plain.choices[0].text
    target = 42
    forced = client.completions.create(
        model=MODEL, prompt=[5, 6], max_tokens=4, temperature=0,
        logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([target] * 4)
    penalized = client.completions.create(
        model=MODEL, prompt=[5, 6], max_tokens=4, temperature=0, frequency_penalty=2.0,
        presence_penalty=2.0, logit_bias={str(target): 3.5},
        extra_body={"ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.2,
                    "min_tokens": 2, "top_k": -1})
    assert penalized.choices[0].text != forced.choices[0].text


def test_a_batch_of_prompts_answers_each_as_alone_in_openai_order(client, tokenizer):
    """Batched prompts (OpenAI's and vLLM's /v1/completions take a list): prompt p's choice j
    is choices[p * n + j], each equal to the prompt sent alone; usage adds the prompts up.
    Before, a batch was refused (400)."""
    prompts = [[5, 6, 7], [40, 41], [9, 10, 11, 12]]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY)
             for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2,
                                      echo=True, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    for k, choice in enumerate(batch.choices):
        assert choice.text == tokenizer.decode(prompts[k // 2]) + alone[k // 2].choices[0].text
    assert batch.usage.prompt_tokens == 9 and batch.usage.completion_tokens == 24
    texts = client.completions.create(model=MODEL, prompt=["hello world", "hi"], max_tokens=3,
                                      **GREEDY)
    assert texts.choices[1].text == client.completions.create(
        model=MODEL, prompt="hi", max_tokens=3, **GREEDY).choices[0].text
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=4,
                                           stream=True, **GREEDY):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {p: alone[p].choices[0].text for p in range(3)}


def test_stop_string_kept_with_include_stop_str_in_output(client):
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, **GREEDY)
    text = whole.choices[0].text
    stop = text[3:5]
    kept = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, stop=[stop],
                                     temperature=0,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=4, stream=True, temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True,
                    "stream_options": {"include_usage": True,
                                       "continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7


def test_tokenize_detokenize_version(server, tokenizer):
    status, body = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "hello world",
                                                      "return_token_strs": True})
    ids = tokenizer.encode("hello world")
    assert status == 200 and json.loads(body) == {
        "count": len(ids), "max_model_len": 256, "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "hi"}]
    status, body = call(server, "POST", "/tokenize", {"messages": messages})
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True)["input_ids"]
    assert status == 200 and json.loads(body)["tokens"] == list(expected)
    status, body = call(server, "POST", "/tokenize", {"prompt": 'a "messages" b'})
    assert status == 200 and json.loads(body)["tokens"] == tokenizer.encode('a "messages" b')
    status, body = call(server, "POST", "/tokenize", b'{"prompt": ')
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = call(server, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and json.loads(body) == {"prompt": "hello world"}
    status, body = call(server, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, body = call(server, "GET", "/version")
    assert status == 200 and json.loads(body)["version"] == "0.1.0"


def test_unsupported_chat_parameters_get_400_naming_them(client):
    for kwargs, param in [
            (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
            (dict(tool_choice="required"), "tool_choice"),
            (dict(extra_body={"guided_regex": "a+"}), "guided_regex"),
            (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]}]),
             "messages[0].tool_calls")]:
        request = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                       max_tokens=2) | kwargs
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**request)
        assert info.value.body["param"] == param, info.value.body
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "frobnicate": 1})
    assert out.choices[0].finish_reason in ("length", "stop")


# ----- chat templates sent in requests -----

TRUSTED_APP = "tpserve-ingress-trusted"
PROMPT_TIMEOUT_S = 3.0
# 3e8 empty Jinja loop iterations: seconds of pure Python (the sandbox caps one range at 1e5).
SLOW_TEMPLATE = ("{% for i in range(3000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


@pytest.fixture(scope="module")
def trusted(server, tiny_llama):
    """A second ingress, in front of the same group, that trusts request chat templates (the
    server fixture's serve.shutdown removes it)."""
    limits = IngressLimits(trust_request_chat_template=True, prompt_timeout_s=PROMPT_TIMEOUT_S)
    app = build_ingress(server["group"], str(tiny_llama), MODEL, BLOCK_SIZE, 256, API_KEY,
                        limits=limits, max_migrations=0)
    serve.run(app, name=TRUSTED_APP, route_prefix="/trusted")
    return {**server, "url": server["url"] + "/trusted"}


def test_request_chat_templates_are_refused_unless_trusted(server, client):
    messages = [{"role": "user", "content": "hi"}]
    for extra, param in [({"chat_template": "{{ messages[0]['content'] }}"}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
                          "chat_template_kwargs.chat_template")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
        assert "--trust-request-chat-template" in info.value.body["message"]
        status, body = call(server, "POST", "/tokenize", {"messages": messages, **extra})
        assert status == 400 and json.loads(body)["error"]["param"] == param, body


def test_a_slow_trusted_template_stalls_neither_health_nor_other_requests(trusted, group):
    group.push_metrics.remote().result()  # /health: 200 while this report is fresh (5 s)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(call, trusted, "POST", "/v1/chat/completions",
                           {**chat, "chat_template": SLOW_TEMPLATE})
        time.sleep(0.5)  # the slow template renders
        start = time.monotonic()
        health, _ = call(trusted, "GET", "/health", key=None)
        status, body = call(trusted, "POST", "/v1/chat/completions", chat)
        waited_s = time.monotonic() - start
        assert (health, status) == (200, 200) and not slow.done(), (
            f"/health {health} and another chat {status} took {waited_s:.1f} s beside the slow "
            f"template (done: {slow.done()})")
        status, body = slow.result()
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "chat_template", error
    assert f"{PROMPT_TIMEOUT_S:g} s" in error["message"], error
