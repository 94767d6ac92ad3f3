"""API fuzzing: schemathesis generates requests from the `/openapi.json` the ingress serves, sent
to the whole product (`build_app`: ingress, KV-aware router, one TP 1 group over a tiny
checkpoint) on a local Ray. No answer may be a 5xx, and every 4xx is OpenAI's error JSON."""

from __future__ import annotations

import os
from collections import Counter
from typing import Dict

import pytest

ray = pytest.importorskip("ray")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from ray import serve  # noqa: E402

from cluster.app import ServeConfig, build_app  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from ray_clusters import stop_local_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

API_KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "X-Request-Timeout": "600"}
MAX_EXAMPLES = int(os.environ.get("TPSERVE_FUZZ_EXAMPLES", "12"))  # per operation; 12: < 1 min



@pytest.fixture(scope="module")
def base_url(tiny_llama):
    port = free_port()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = EngineConfig(model=str(tiny_llama), tp_size=1, block_size=4,
                              num_kv_blocks=1024)
        serve.run(build_app(ServeConfig(engine=engine, api_key=API_KEY, ingress_replicas="1",
                                        served_model_name="tiny"), ray.cluster_resources()),
                  name="tpserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_local_ray()


def assert_openai_error(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_no_5xx_and_every_4xx_is_openai_error_json(base_url):
    """Each operation of the description, ``MAX_EXAMPLES`` generated cases each. (Driven
    through hypothesis directly: schemathesis' pytest plugin does not load under pytest 9.)"""
    api = schemathesis.openapi.from_url(base_url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    paths = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
            "POST /detokenize", "GET /v1/models"} <= paths, paths
    statuses: Dict[str, Counter] = {}
    for operation in operations:
        seen = statuses.setdefault(f"{operation.method.upper()} {operation.path}", Counter())

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def check(case):
            # A deadline the client chose (X-Request-Timeout) ends in its own 504: the header
            # is checked in test_request_limits.py, not fuzzed here.
            response = case.call(base_url=base_url, headers=HEADERS, timeout=60)
            assert response.status_code < 500, (response.status_code, response.text[:500],
                                                case.as_curl_command())
            seen[response.status_code] += 1
            if response.status_code >= 400:
                assert_openai_error(response)

        check()
    print("\nfuzzed:", {op: dict(counts) for op, counts in statuses.items()})
