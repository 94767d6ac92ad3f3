"""A real local Ray Serve running the ingress, for the ingress tests (test_ingress_ray.py,
test_ingress_options_ray.py): import the fixtures into a test module, which then gets its own
Serve app for the module.

A group-like deployment runs the real `AsyncLLMEngine` over a tiny checkpoint (TP 1, in the
replica) and streams with `cluster.groups.stream.stream_chunks`, the code the TP group deployment
uses; it can slow its steps (to disconnect mid-stream) and fail on demand (to see the errors).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import cloudpickle, serve  # noqa: E402

from cluster.contract import GroupRequest  # noqa: E402
from cluster.groups.stream import stream_chunks  # noqa: E402
from cluster.api.api_key import ApiKey  # noqa: E402
from cluster.api.ingress import build_ingress  # noqa: E402
from cluster.metrics import get_metrics_store  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from workers.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.tokenizer import load_tokenizer  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402


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
            model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=128, dtype="float32")))
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
def server(tiny_llama, tmp_path_factory):
    # Replicas cannot import this helper module: ship the classes defined here by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    port = free_port()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # No migration: the stand-in group fails on demand, and the error it maps to is tested
        # here (migration is tested against real groups in test_serve_failover).
        # The key comes from a file, as a mounted Secret would bring it (rotated in a test).
        key_file = tmp_path_factory.mktemp("api_key") / "key"
        key_file.write_text(API_KEY + "\n")
        app = build_ingress(TinyGroup.bind(str(tiny_llama)), str(tiny_llama), MODEL,
                            BLOCK_SIZE, 256, ApiKey((API_KEY,), file=str(key_file)),
                            max_migrations=0)
        serve.run(app, name=APP, route_prefix="/")
        group = serve.get_deployment_handle("TinyGroup", app_name=APP)
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "group": group,
               "model_dir": tiny_llama, "key_file": key_file}
    finally:
        stop_local_ray()


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
