"""Run inside the head's network namespace by `test_netns_serving.py`: serve one TP 2 group that
spans the two namespaces (placed by the topology plan, one CPU rank slot per node), check greedy
output against transformers', kill the worker namespace's Ray, and time the health check.

    netns_driver.py ADDRESS HOST MODEL_DIR EXPECTED_JSON WORKER_NETNS

Prints one JSON line: the ranks (node ip, socket interface), the texts, `health_failed_after_s`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import ray
from ray import serve

from cluster.app import ServeConfig, build_app
from cluster.cli.status import collect_status
from workers.config import EngineConfig


def serve_and_check(host: str, model_dir: str, expected: dict) -> dict:
    serve.start(http_options={"host": host, "port": 8000}, proxy_location="HeadOnly")
    engine = EngineConfig(model=model_dir, tp_size=2, block_size=4, num_kv_blocks=64,
                          dtype="float32")
    config = ServeConfig(engine=engine, placement="plan", cpu_ranks_per_node=1,
                         ingress_replicas="1",
                         served_model_name="tiny")
    serve.run(build_app(config, ray.cluster_resources()), name="tpserve", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://{host}:8000/v1", api_key="unused", max_retries=0,
                           timeout=120)
    texts = [client.completions.create(model="tiny", prompt=prompt, max_tokens=expected["max"],
                                       temperature=0.0).choices[0].text
             for prompt in expected["prompts"]]
    ranks = serve.get_deployment_handle("TPGroup", app_name="tpserve").rank_info.remote().result()
    nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    status = collect_status()
    return {"texts": texts, "ranks": [{**r, "ip": nodes.get(r["node"])} for r in ranks],
            "plan": status["plan"]}


def kill_worker_and_time_health(worker_netns: str, timeout_s: float = 90.0) -> float:
    pids = subprocess.run(["ip", "netns", "pids", worker_netns], capture_output=True,
                          text=True, check=True).stdout.split()
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() - killed < timeout_s:
        deployment = serve.status().applications["tpserve"].deployments["TPGroup"]
        if deployment.status != "HEALTHY" or deployment.replica_states.get("RUNNING", 0) == 0:
            return time.monotonic() - killed
        time.sleep(0.5)
    return float("inf")


def main() -> int:
    address, host, model_dir, expected_path, worker_netns = sys.argv[1:6]
    with open(expected_path, encoding="utf-8") as handle:
        expected = json.load(handle)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        result = serve_and_check(host, model_dir, expected)
        result["health_failed_after_s"] = kill_worker_and_time_health(worker_netns)
    finally:
        # The test kills every process of the namespaces next, Serve's and the named actors'
        # with them: serve.shutdown() first would wait out each deployment's graceful stop.
        ray.shutdown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
