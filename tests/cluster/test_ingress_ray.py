"""The ingress on a real local Ray Serve, driven by the official `openai` client: endpoints,
streaming, errors, auth, failures, disconnects and metrics (the app: ingress_app.py).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cluster.api.ingress import HEALTH_MAX_REPORT_AGE_S  # noqa: E402
from kv.prefix_hash import extend_block_hashes  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from ingress_app import (  # noqa: F401 (fixtures)
    API_KEY, BLOCK_SIZE, GREEDY, MODEL, call, client, group, server, tokenizer)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


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
    (dict(extra_body={"response_format": {"type": "xml"}}), "response_format.type: expected"),
    (dict(extra_body={"guided_json": {"$ref": "#/$defs/Missing"}}),
     "guided_json: invalid json_schema"),  # built by xgrammar on the ingress's prompt pool
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


def test_tools_on_a_model_without_a_tool_call_format_are_a_400(client):
    # The tiny checkpoint's chat template has no tool section, and no --tool-call-parser is set.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=tools, max_tokens=4)
    assert info.value.body["param"] == "tools" and "--tool-call-parser" in info.value.message


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


def test_a_rotated_key_file_takes_effect_without_a_restart(server):
    """Add a key, then drop the old one: each change reaches the replica within seconds."""
    key_file = server["key_file"]

    def status_with(key):
        return call(server, "GET", "/v1/models", key=key)[0]

    def settles(key, want):
        deadline = time.monotonic() + 10
        while status_with(key) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        return status_with(key)

    try:
        key_file.write_text(f"{API_KEY}\nrotated-key\n")
        assert settles("rotated-key", 200) == 200 and status_with(API_KEY) == 200
        key_file.write_text("rotated-key\n")
        assert settles(API_KEY, 401) == 401 and status_with("rotated-key") == 200
        key_file.write_text("")  # a broken file keeps the keys the replica has: never open
        time.sleep(1.5)
        assert status_with("rotated-key") == 200 and status_with(None) == 401
    finally:
        key_file.write_text(API_KEY + "\n")
        assert settles(API_KEY, 200) == 200


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
