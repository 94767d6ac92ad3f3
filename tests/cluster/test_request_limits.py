"""Request limits without Ray: admission, body size, deadlines, their configuration, and the
OpenAPI description (the Ray tests are in test_limits_ray.py and test_api_fuzz_ray.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from cluster.api.admission import IngressAdmission, group_max_ongoing_requests
from cluster.app import ServeConfig, request_limits
from cluster.api.protocol import ProtocolError
from cluster.contract import GroupChunk
from cluster.api.request_limits import (
    MIB,
    DeadlineStream,
    IngressLimits,
    read_body,
    request_timeout_s,
)
from workers.config import EngineConfig


def test_admission_refuses_past_the_limit_with_429_and_retry_after():
    admission = IngressAdmission(2, retry_after_s=1.5)
    first, second = admission.acquire(), admission.acquire()
    with pytest.raises(ProtocolError) as info:
        admission.acquire()
    assert info.value.status == 429 and info.value.headers() == {"Retry-After": "2"}
    assert "limit of 2 requests" in info.value.message and admission.num_rejected == 1
    first()
    first()  # a release is idempotent: the slot is given back once
    assert admission.num_in_flight == 1
    admission.acquire()
    second()
    assert admission.num_in_flight == 1


def test_group_capacity_comes_from_max_num_seqs_and_kv_blocks():
    assert group_max_ongoing_requests(128, None) == 256
    assert group_max_ongoing_requests(128, 8) == 16  # a tiny pool runs at most 8 sequences
    assert group_max_ongoing_requests(4, 1000) == 8
    with pytest.raises(ValueError, match="num_kv_blocks must be at least 1"):
        group_max_ongoing_requests(4, 0)


def test_serve_config_derives_and_validates_the_limits():
    engine = EngineConfig(model="default", max_num_seqs=16, num_kv_blocks=64)
    per_group, queued, limits = request_limits(ServeConfig(engine=engine, max_groups=3))
    assert (per_group, queued) == (32, 96)
    assert limits.max_in_flight == 3 * 32 + 96 and limits.max_body_bytes == 4 * MIB
    assert limits.request_timeout_s == 600
    _, queued, limits = request_limits(ServeConfig(
        engine=engine, max_queued_requests=5, max_request_body_mb=0.5, request_timeout_s=9))
    assert queued == 5 and limits.max_in_flight == 32 + 5
    assert limits.max_body_bytes == MIB // 2 and limits.request_timeout_s == 9
    for kwargs, words in [
            (dict(max_queued_requests=0), "--max-queued-requests must be a positive integer"),
            (dict(max_queued_requests=-1), "--max-queued-requests must be a positive integer"),
            (dict(max_request_body_mb=0), "--max-request-body-mb must be a positive"),
            (dict(request_timeout_s=float("inf")), "--request-timeout-s must be a positive"),
            (dict(request_timeout_s=-1), "--request-timeout-s must be a positive")]:
        with pytest.raises(ValueError, match=words):
            ServeConfig(engine=engine, **kwargs)
    with pytest.raises(ValueError, match="request_timeout_s must be a positive"):
        IngressLimits(request_timeout_s=float("nan"))


def test_the_cli_refuses_a_bad_limit_before_starting_anything(tiny_llama, capsys):
    from cluster.cli.main import main

    assert main(["serve", "--model", str(tiny_llama), "--max-queued-requests", "0"]) == 2
    assert "--max-queued-requests must be a positive integer" in capsys.readouterr().err


def test_the_client_may_ask_for_a_shorter_timeout_not_a_longer_one():
    assert request_timeout_s({}, 600.0) == 600.0
    assert request_timeout_s({"x-request-timeout": "2.5"}, 600.0) == 2.5
    assert request_timeout_s({"x-request-timeout": "9000"}, 600.0) == 600.0
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(ProtocolError, match="X-Request-Timeout must be a positive") as info:
            request_timeout_s({"x-request-timeout": bad}, 600.0)
        assert info.value.status == 400 and info.value.param == "X-Request-Timeout"


def _request(chunks, headers=()):
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)]

    async def receive():
        return pending.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (k.encode(), v.encode()) for k, v in headers]}
    return Request(scope, receive)


def test_a_body_past_the_limit_is_refused_with_413():
    ok = asyncio.run(read_body(_request([b"ab", b"cd"]), max_bytes=4))
    assert ok == b"abcd"
    with pytest.raises(ProtocolError) as info:  # declared too large: nothing is read
        asyncio.run(read_body(_request([], [("content-length", "5000")]), max_bytes=4096))
    assert info.value.status == 413 and "limit of 4096 bytes" in info.value.message
    assert info.value.body()["error"]["code"] == "request_too_large"
    with pytest.raises(ProtocolError) as info:  # chunked, no length: stops once past it
        asyncio.run(read_body(_request([b"abc", b"def", b"never read"]), max_bytes=4))
    assert info.value.status == 413


class _SlowStream:
    def __init__(self, delay_s):
        self.delay_s, self.finished, self.num_cancels = delay_s, False, 0

    async def __anext__(self):
        await asyncio.sleep(self.delay_s)
        return GroupChunk("r", (1,), "a", False, None, 1, 1)

    def cancel(self):
        self.num_cancels += 1
        self.finished = True


def test_a_stream_past_its_deadline_is_cancelled_and_answers_504():
    async def run():
        stream = _SlowStream(0.01)
        deadline = DeadlineStream(stream, timeout_s=0.2)
        chunks = 0
        with pytest.raises(ProtocolError) as info:
            while True:
                await deadline.__anext__()
                chunks += 1
        return stream, chunks, info.value

    stream, chunks, error = asyncio.run(run())
    assert 3 <= chunks < 20 and stream.num_cancels == 1
    assert error.status == 504 and "time limit of 0.2 s" in error.message
    assert error.body()["error"]["code"] == "request_timeout"

    async def stuck():  # no chunk at all (e.g. queued for a group) still ends on time
        stream = _SlowStream(30)
        with pytest.raises(ProtocolError, match="time limit"):
            await asyncio.wait_for(DeadlineStream(stream, 0.1).__anext__(), 5)
        return stream

    assert asyncio.run(stuck()).num_cancels == 1


def test_openapi_describes_the_request_bodies_and_errors():
    from cluster.api.ingress import app
    from cluster.api.openapi_schema import openapi_document

    app.openapi_schema = None
    doc = json.loads(json.dumps(openapi_document(app, ["tiny"])))
    app.openapi_schema = None
    schemas = doc["components"]["schemas"]
    post = doc["paths"]["/v1/completions"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == ["tiny"]
    assert {"prompt", "model"} <= set(schemas["CompletionRequest"]["required"])
    assert "ChatMessage" in schemas and "StreamOptions" in schemas
    assert {"400", "413", "429", "504"} <= set(post["responses"]) and "422" not in \
        post["responses"]
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]
    assert len(tokenize["application/json"]["schema"]["oneOf"]) == 2
    assert "/detokenize" in doc["paths"] and "/v1/chat/completions" in doc["paths"]


def test_a_batch_takes_a_slot_per_prompt():
    admission = IngressAdmission(4, retry_after_s=1.5)
    request = admission.acquire()
    batch = admission.acquire(3, held=1)  # a batch of 4 prompts: its request's slot, 3 more
    assert admission.num_in_flight == 4
    with pytest.raises(ProtocolError) as info:
        admission.acquire(2, held=1)
    assert info.value.status == 429 and admission.num_in_flight == 4
    batch()
    batch()
    assert admission.num_in_flight == 1
    with pytest.raises(ProtocolError) as info:  # can never fit: a 400 that says the limit
        admission.acquire(4, held=1)
    assert info.value.status == 400 and info.value.param == "prompt"
    assert "a batch of 5 prompts" in info.value.message and "at most 4" in info.value.message
    request()
    assert admission.num_in_flight == 0
    one = IngressAdmission(1)
    one.acquire()
    with pytest.raises(ProtocolError) as info:  # a single request at a full server: a 429
        one.acquire()
    assert info.value.status == 429
