"""The ingress's request options on a real local Ray Serve, driven by the official `openai`
client: n choices, echo, batches, stop strings, usage stats, tokenize, refused parameters and
request chat templates (the app: ingress_app.py).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.api.api_key import ApiKey  # noqa: E402
from cluster.api.ingress import build_ingress  # noqa: E402
from cluster.api.request_limits import IngressLimits  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402
from ingress_app import (  # noqa: F401 (fixtures)
    API_KEY, BLOCK_SIZE, GREEDY, MODEL, call, client, group, server, tokenizer)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


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


def test_bad_chat_parameters_get_400_naming_them(client):
    """Tools on a model without a tool-call format, a tool choice without tools, a regex that
    cannot build, a history call whose arguments are not a JSON object."""
    for kwargs, param in [
            (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
            (dict(tool_choice="required"), "tool_choice"),
            (dict(extra_body={"guided_regex": "[a-"}), "guided_regex"),  # cannot build
            (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "f", "arguments": "[1]"}}]}]),
             "messages[0].tool_calls[0].function.arguments")]:
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
    app = build_ingress(server["group"], str(tiny_llama), MODEL, BLOCK_SIZE, 256,
                        ApiKey((API_KEY,)), limits=limits, max_migrations=0)
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
