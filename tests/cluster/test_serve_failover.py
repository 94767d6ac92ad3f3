"""A rank actor that dies takes its TP group down cleanly: the request in flight fails fast with
an error (no hang), the replica reports unhealthy, Serve replaces the group, and new requests are
served again."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from test_serve_e2e import local_serving  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def client(tiny_llama):
    with local_serving(tiny_llama) as openai_client:
        yield openai_client


def rank_pids():
    """Process ids of the group's ranks (rank 0: the replica; rank 1: its Ray actor)."""
    handle = serve.get_deployment_handle("TPGroup", app_name="tpserve")
    return [rank["pid"] for rank in handle.rank_info.remote().result()]


def test_killed_rank_fails_the_stream_and_the_group_is_replaced(client):
    assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2).usage
    pid = rank_pids()[1]
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=240,
                                       stream=True, extra_body={"ignore_eos": True})
    started = time.monotonic()
    received = 0
    with pytest.raises(openai.APIError):
        for _ in stream:
            received += 1
            if received == 2:
                os.kill(pid, signal.SIGKILL)  # rank 1 crashes mid-generation
    assert time.monotonic() - started < 60  # failed fast, did not hang on the collective
    assert received < 240
    # The failed collective is counted; the alerts on collective errors read this.
    assert wait_for_metric(client, "tpserve:collective_errors_total", timeout_s=30) >= 1

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Serve replaces the whole group (new rank actor too)
        try:
            out = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3,
                                            temperature=0.0)
            if out.usage.completion_tokens == 3 and pid not in rank_pids():
                break
        except openai.APIError:
            pass
        time.sleep(1.0)
    else:
        pytest.fail("the TP group was not replaced within 120 s")
    assert len(rank_pids()) == 2
    status = serve.status().applications["tpserve"].deployments["TPGroup"].status
    assert status == "HEALTHY"
    # ... and so is the group's failure (the "group replica restarting" alert).
    assert wait_for_metric(client, "tpserve:group_failures_total", timeout_s=30) >= 1


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
