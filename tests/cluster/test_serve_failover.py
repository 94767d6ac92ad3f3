"""A rank actor that dies takes its TP group down cleanly and loses no request: the request in
flight waits for a healthy group (here the replacement Serve starts: the only group died) and
continues there, resumed after the tokens it already streamed; the client sees one stream equal
to the uninterrupted one. The replica reports unhealthy and Serve replaces the whole group.
A gRPC stream takes the same path."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.ports import free_port  # noqa: E402
from test_serve_e2e import API_KEY, local_serving  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


STEP_TIMEOUT_S = 5.0  # a hung rank fails its group this fast (the default is 30 s)


@pytest.fixture(scope="module")
def grpc_port():
    return free_port()


@pytest.fixture(scope="module")
def client(tiny_llama, grpc_port):
    with local_serving(tiny_llama, grpc_port, step_timeout_s=STEP_TIMEOUT_S) as openai_client:
        yield openai_client


def rank_pids():
    """Process ids of the group's ranks (rank 0: the replica; rank 1: its Ray actor)."""
    handle = serve.get_deployment_handle("TPGroup", app_name="tpserve")
    return [rank["pid"] for rank in handle.rank_info.remote().result()]


def test_a_killed_rank_migrates_the_stream_which_completes_unchanged(client):
    prompt, max_tokens = [5, 6, 7], 120
    greedy = dict(temperature=0.0, extra_body={"ignore_eos": True})
    reference = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                          **greedy)
    pid = rank_pids()[1]
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       stream=True, **greedy)
    texts, finish, received = [], None, 0
    for chunk in stream:  # no error event: the stream goes on on the replacement group
        received += 1
        texts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if received == 2:
            os.kill(pid, signal.SIGKILL)  # rank 1 crashes mid-generation
    assert "".join(texts) == reference.choices[0].text
    assert finish == "length"
    assert pid not in rank_pids() and len(rank_pids()) == 2  # the whole group was replaced
    status = serve.status().applications["tpserve"].deployments["TPGroup"].status
    assert status == "HEALTHY"
    assert wait_for_metric(client, "tpserve:request_migrations_total", timeout_s=10) >= 1
    # The failed collective is counted (the alerts on collective errors read this), and so is
    # the group's failure (the "group replica restarting" alert).
    assert wait_for_metric(client, "tpserve:collective_errors_total", timeout_s=30) >= 1
    assert wait_for_metric(client, "tpserve:group_failures_total", timeout_s=30) >= 1


def test_a_hung_rank_migrates_the_stream_which_completes_unchanged(client):
    """SIGSTOP, not SIGKILL: the rank's process and sockets stay, so nothing fails by itself;
    the step deadline (the watchdog, or the collective's timeout) must notice."""
    prompt, max_tokens = [9, 8, 7, 6], 100
    greedy = dict(temperature=0.0, extra_body={"ignore_eos": True})
    reference = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                          **greedy)
    pid = rank_pids()[1]
    texts, received = [], 0
    started = time.monotonic()
    try:
        for chunk in client.completions.create(model="tiny", prompt=prompt,
                                               max_tokens=max_tokens, stream=True, **greedy):
            received += 1
            texts.append(chunk.choices[0].text)
            if received == 2:
                os.kill(pid, signal.SIGSTOP)  # rank 1 freezes mid-generation
    finally:
        with contextlib.suppress(ProcessLookupError):  # Serve may have killed it already
            os.kill(pid, signal.SIGKILL)  # whatever happened, never leave a stopped process
    assert "".join(texts) == reference.choices[0].text
    assert time.monotonic() - started < 110
    assert pid not in rank_pids()


def wait_for_metric(client, name: str, timeout_s: float) -> float:
    """The sum over label sets of ``name`` in /metrics, once it is above 0 (or at the timeout)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        total = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == name)
        if total > 0 or time.monotonic() > deadline:
            return total
        time.sleep(0.5)


def test_a_killed_rank_migrates_a_grpc_stream_too(client, grpc_port):
    grpc = pytest.importorskip("grpc")
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb
    from cluster.proto.tpserve.v1 import tpserve_pb2_grpc as pb_grpc

    request = pb.CompletionRequest(model="tiny", prompt_token_ids=[5, 6, 7], max_tokens=120,
                                   temperature=0, ignore_eos=True)
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.TPServeStub(channel)
        reference = stub.Complete(request, metadata=metadata, timeout=120)
        pid = rank_pids()[1]
        chunks = []
        for chunk in stub.CompleteStream(request, metadata=metadata, timeout=180):
            chunks.append(chunk)
            if len(chunks) == 2:
                os.kill(pid, signal.SIGKILL)  # rank 1 crashes mid-generation
    assert [t for c in chunks for t in c.token_ids] == list(reference.token_ids)
    assert "".join(c.text for c in chunks) == reference.text
    assert chunks[-1].finish_reason == "length" and pid not in rank_pids()
