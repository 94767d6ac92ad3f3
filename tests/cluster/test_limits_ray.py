"""Limits on a real local Ray Serve app: the ingress in front of a group deployment that runs the
real `AsyncLLMEngine` over a tiny checkpoint (as test_ingress_ray.py), with tiny limits so each
one is reached deterministically: one request slot in the group, one queued request, three in
the ingress, 64 KiB bodies, an 8 s server timeout. Steps can be slowed so a request holds its
slot; the group's scheduler state shows that an aborted request freed its KV blocks."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
from ray import cloudpickle, serve  # noqa: E402
from ray.serve.config import BackpressureConfig  # noqa: E402

from cluster.contract import GroupRequest  # noqa: E402
from cluster.groups.stream import stream_chunks  # noqa: E402
from cluster.api.ingress import build_ingress  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from cluster.api.request_limits import IngressLimits  # noqa: E402
from workers.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = "tiny"
APP = "tpserve-limits-test"
BODY_LIMIT = 64 * 1024
SERVER_TIMEOUT_S = 8.0
STEP_DELAY_S = 0.05
LIMITS = IngressLimits(max_in_flight=3, max_body_bytes=BODY_LIMIT,
                       request_timeout_s=SERVER_TIMEOUT_S, retry_after_s=2.0)


class SlowableEngine(LLMEngine):
    step_delay_s = 0.0

    def step(self):
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return super().step()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class OneSlotGroup:
    def __init__(self, model_dir: str) -> None:
        self.engine = AsyncLLMEngine(lambda: SlowableEngine(EngineConfig(
            model=model_dir, block_size=4, num_kv_blocks=128)))
        self.failure = None

    async def generate(self, request: GroupRequest, num_tokens: int = 0, block_hashes=()):
        if self.failure:
            raise EngineDeadError("engine failed: rank 1 died")
        async for chunk in stream_chunks(self.engine, request):
            yield chunk

    def configure(self, step_delay_s: float = 0.0, failure=None) -> None:
        self.engine.engine.step_delay_s = step_delay_s
        self.failure = failure

    def state(self) -> dict:
        sched = self.engine.engine.scheduler
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_blocks_used": self.engine.load.kv.num_used_blocks}



@pytest.fixture(scope="module")
def server(tiny_llama):
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    port = free_port()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        group = OneSlotGroup.options(
            max_ongoing_requests=1, max_queued_requests=1,
            backpressure_config=BackpressureConfig(status_code=429, retry_after_s=2.0))
        serve.run(build_ingress(group.bind(str(tiny_llama)), str(tiny_llama), MODEL, 4, 256,
                                limits=LIMITS, max_migrations=0), name=APP, route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "port": port,
               "group": serve.get_deployment_handle("OneSlotGroup", app_name=APP)}
    finally:
        stop_local_ray()


@pytest.fixture
def group(server):
    group = server["group"]
    group.configure.remote().result()
    yield group
    group.configure.remote().result()
    wait_until_idle(group)


def wait_until_idle(group, timeout_s=20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    state = group.state.remote().result()
    while time.monotonic() < deadline and (state["num_running"] or state["num_waiting"]
                                           or state["kv_blocks_used"]):
        time.sleep(0.1)
        state = group.state.remote().result()
    return state


def post(server, path, body, headers=None, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server["url"] + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def long_request(stream=False, max_tokens=200):
    return {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def open_stream(server, body, headers=None):
    """A streaming request whose first event has arrived (so it holds the group's slot)."""
    conn = socket.create_connection(("127.0.0.1", server["port"]), timeout=60)
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n{head}\r\n".encode() + data)
    reader = conn.makefile("rb")
    status = int(reader.readline().split()[1])
    while reader.readline() not in (b"\r\n", b""):
        pass
    return conn, reader, status


def sse_events(reader):
    """The data lines of a chunked SSE body, until [DONE] or the end."""
    events = []
    for line in reader:
        line = line.strip()
        if line.startswith(b"data: "):
            events.append(line[len(b"data: "):].decode())
            if events[-1] == "[DONE]":
                break
    return events


def assert_openai_error(status, headers, body, want_status, code):
    error = json.loads(body)["error"]
    assert status == want_status, (status, body)
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def test_beyond_the_group_queue_429_with_retry_after(server, group):
    group.configure.remote(step_delay_s=STEP_DELAY_S).result()
    conn, reader, status = open_stream(server, long_request(stream=True))
    assert status == 200 and reader.readline()  # the first chunk: it holds the group's slot
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(post, server, "/v1/completions", long_request(max_tokens=4))
        time.sleep(1.0)  # it waits at the ingress's handle for the group's one slot
        status, headers, body = post(server, "/v1/completions", long_request(max_tokens=4))
        error = assert_openai_error(status, headers, body, 429, "overloaded")
        assert headers.get("Retry-After") == "2" and "queue for them is full" in error["message"]
        assert not queued.done()
        reader.close()  # the stream goes away: the queued request gets the slot and finishes
        conn.close()
        assert queued.result(timeout=60)[0] == 200


def test_beyond_the_ingress_limit_429_before_the_body_is_read(server, group):
    group.configure.remote(step_delay_s=STEP_DELAY_S).result()
    held = [open_stream(server, long_request(stream=True))]
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(post, server, "/v1/completions", long_request(max_tokens=4))
        time.sleep(1.0)
        # A third request that holds an ingress slot: its body never finishes arriving.
        slow = socket.create_connection(("127.0.0.1", server["port"]), timeout=60)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                     b"Content-Type: application/json\r\n\r\n{\"model\"")
        time.sleep(1.0)
        status, headers, body = post(server, "/v1/completions", long_request(max_tokens=4))
        error = assert_openai_error(status, headers, body, 429, "overloaded")
        assert headers.get("Retry-After") == "2" and "limit of 3 requests" in error["message"]
        slow.close()
        for conn, reader, _ in held:
            reader.close()
            conn.close()
        assert queued.result(timeout=60)[0] == 200


def test_a_batch_takes_an_ingress_slot_per_prompt(server, group):
    # 4 prompts can never run under the ingress's limit of 3: a 400 that says so
    # (test_ingress_ray runs batches that fit).
    status, headers, body = post(server, "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [[5, 6]] * 4, "max_tokens": 2}).encode())
    error = assert_openai_error(status, headers, body, 400, None)
    assert error["param"] == "prompt" and "send at most 3 prompts" in error["message"]


def test_a_failed_group_503_with_retry_after(server, group):
    group.configure.remote(failure="before").result()
    status, headers, body = post(server, "/v1/completions", long_request(max_tokens=4))
    assert_openai_error(status, headers, body, 503, "group_failed")
    assert headers.get("Retry-After") == "1"  # the default for a failed group


def test_a_body_past_the_limit_413(server, group):
    big = json.dumps({"model": MODEL, "prompt": "x " * BODY_LIMIT}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        status, headers, body = post(server, path, big)
        error = assert_openai_error(status, headers, body, 413, "request_too_large")
        assert f"limit of {BODY_LIMIT} bytes" in error["message"]
    # Chunked, with no Content-Length: refused once it grows past the limit.
    conn = socket.create_connection(("127.0.0.1", server["port"]), timeout=60)
    conn.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 b"Content-Type: application/json\r\n\r\n")
    piece = b"x" * 16384
    try:
        for _ in range(8):
            conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.sendall(b"0\r\n\r\n")
    except OSError:
        pass  # the server may answer and close before the whole body is sent
    reply = http.client.HTTPResponse(conn)
    reply.begin()
    body = reply.read()
    conn.close()
    assert reply.status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_a_request_past_its_timeout_504_and_its_blocks_are_freed(server, group):
    group.configure.remote(step_delay_s=STEP_DELAY_S).result()
    started = time.monotonic()
    status, headers, body = post(server, "/v1/completions", long_request(),
                                 headers={"X-Request-Timeout": "1.5"})
    elapsed = time.monotonic() - started
    error = assert_openai_error(status, headers, body, 504, "request_timeout")
    assert "time limit of 1.5 s" in error["message"] and 1.4 < elapsed < 6
    state = wait_until_idle(group)
    assert state == {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0}


def test_a_stream_past_the_server_timeout_ends_with_an_error_event_and_frees_blocks(server,
                                                                                  group):
    group.configure.remote(step_delay_s=STEP_DELAY_S).result()
    started = time.monotonic()
    conn, reader, status = open_stream(server, long_request(stream=True, max_tokens=250))
    assert status == 200
    events = sse_events(reader)
    reader.close()
    conn.close()
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] is not None
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout" and f"{SERVER_TIMEOUT_S:g} s" in error["message"]
    assert SERVER_TIMEOUT_S - 0.5 < elapsed < SERVER_TIMEOUT_S + 5
    state = wait_until_idle(group)
    assert state == {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0}


def ingress_process():
    found = [p for p in psutil.process_iter(["cmdline"])
             if any(f"{APP}:OpenAIIngress" in part for part in p.info["cmdline"] or ())]
    assert len(found) == 1, found
    return found[0]


def test_a_flood_keeps_the_ingress_memory_bounded(server, group):
    """600 requests, 64 at a time, 400 with a body just under the limit and 200 over it, while
    the group is slow: all but a few are turned away (429 / 413) and the ingress's RSS stays
    within 64 MiB of where it started (the bound: its max_ongoing_requests bodies at once)."""
    group.configure.remote(step_delay_s=STEP_DELAY_S).result()
    ingress = ingress_process()
    before = ingress.memory_info().rss
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], ingress.memory_info().rss)

    near_limit = json.dumps(long_request(max_tokens=8) | {
        "user": "u" * (BODY_LIMIT - 200)}).encode()
    over_limit = near_limit + b" " * 1024

    def one(i):
        status, _, body = post(server, "/v1/completions",
                               over_limit if i % 3 == 2 else near_limit, timeout=120)
        return status if body.startswith(b'{"error"') or status == 200 else f"{status} text"

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(one, range(600)))
    stop.set()
    sampler.join()
    after = ingress.memory_info().rss
    counts = {s: statuses.count(s) for s in sorted(set(statuses), key=str)}
    print(f"\nflood: 600 requests (64 KiB bodies, 64 at a time) -> {counts}; ingress RSS "
          f"before {before / 2**20:.1f} MiB, peak {peak[0] / 2**20:.1f} MiB, after "
          f"{after / 2**20:.1f} MiB (+{(peak[0] - before) / 2**20:.1f} MiB at the peak)")
    # No "429 text" (Serve's proxy turning a request away, with its plain-text body): every
    # refusal is the ingress's, in OpenAI's error JSON; a declared 413 comes before admission.
    assert set(counts) <= {200, 413, 429} and counts[413] == 200 and counts[429] >= 300, counts
    assert peak[0] - before < 64 * 2**20
