"""`serve run deploy/ray/serve.yaml` on a local Ray answers the official `openai` client, and its
`/metrics` exposes every metric that the alert rules and the Grafana dashboard query.

The test runs Serve's own `serve run` CLI on a copy of deploy/ray/serve.yaml in which only what
this machine cannot take is replaced (`serve run` ignores key=value overrides for a config file):
the model (a tiny checkpoint built here), `device: cpu`, sizes in blocks instead of GiB (KV pool
and tiers), `max_model_len`, the disk tier's directory and the HTTP port. Everything else (import
path, TP 2, groups "1:8", two ingress replicas, KV target, eviction, `api_key_file:
~/.tpserve/api_key` under a HOME of the test's own) runs as written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster.ports import free_port
from monitoring import (GPU_ONLY, PROMETHEUS_SERIES, REPO, alert_exprs, dashboard_exprs,
                        metric_names, read_alerts, read_dashboard, scraped_names)

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

API_KEY = "serve-run-key"



def config_for_this_machine(model_dir: Path, tmp_path: Path, port: int) -> Path:
    config = yaml.safe_load((REPO / "deploy" / "ray" / "serve.yaml").read_text())
    config["http_options"].update(host="127.0.0.1", port=port)
    args = config["applications"][0]["args"]
    for key in ("kv_cache_gb", "host_kv_gb", "disk_kv_gb"):
        del args[key]
    args.update(model=str(model_dir), device="cpu", kv_blocks=64, block_size=4, max_model_len=128,
                host_kv_blocks=32, disk_kv_dir=str(tmp_path / "kv"), disk_kv_blocks=64)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def get(url: str) -> tuple:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None, ""


def wait_serving(process: subprocess.Popen, base: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve run exited {process.returncode}")
        if get(f"{base}/health")[0] == 200:
            return
        time.sleep(1)
    raise AssertionError(f"{base} did not become healthy in {timeout_s} s")


def stop(process: subprocess.Popen) -> None:
    """Ctrl-C as a user would (Serve shuts down, the driver stops the Ray it started), then
    whatever is left of the process group this test started."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("serve_run")
    port = free_port()
    config = config_for_this_machine(tiny_llama, tmp_path, port)
    home = tmp_path / "home"
    (home / ".tpserve").mkdir(parents=True)
    (home / ".tpserve" / "api_key").write_text(API_KEY + "\n")
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0"}
    serve_cli = Path(sys.executable).parent / "serve"
    log = open(tmp_path / "serve_run.log", "w")
    process = subprocess.Popen([str(serve_cli), "run", "--address", "local", str(config)],
                               cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serving(process, base)
        yield base
    except AssertionError:
        log.flush()
        print((tmp_path / "serve_run.log").read_text()[-6000:])
        raise
    finally:
        stop(process)
        log.close()


def test_serve_run_of_the_config_file_answers_the_openai_client(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["qwen2.5-7b-instruct"]
    out = client.completions.create(model="qwen2.5-7b-instruct", prompt="the quick brown",
                                    max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="qwen2.5-7b-instruct", max_tokens=4,
                                          messages=[{"role": "user", "content": "hello"}])
    assert chat.usage.completion_tokens >= 1
    # The key in the file named by api_key_file is enforced.
    stranger = openai.OpenAI(base_url=f"{served}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_every_metric_the_alerts_and_dashboard_query_is_exposed(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    client.completions.create(model="qwen2.5-7b-instruct", prompt="hello", max_tokens=2)
    wanted = set()
    for expr in alert_exprs(read_alerts()).values():
        wanted |= metric_names(expr)
    for expr in dashboard_exprs(read_dashboard()):
        wanted |= metric_names(expr)
    wanted -= PROMETHEUS_SERIES | GPU_ONLY  # this machine has no GPU
    deadline = time.monotonic() + 30
    while True:  # groups push their numbers about once a second
        status, text = get(f"{served}/metrics")
        assert status == 200, text[:500]
        missing = wanted - scraped_names(text)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, f"queried but not exposed: {sorted(missing)}"
    assert len(wanted) >= 8


def scraped_total(base: str, name: str) -> float:
    status, text = get(f"{base}/metrics")
    assert status == 200, text[:500]
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def ingress_replica_processes() -> int:
    return sum(1 for p in psutil.process_iter(["cmdline"])
               if any(":OpenAIIngress" in part for part in p.info["cmdline"] or ()))


def test_metrics_add_up_over_the_ingress_replicas(served):
    """serve.yaml runs two ingress replicas: /metrics says the same whichever one answers."""
    assert ingress_replica_processes() >= 2
    client = openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    name = "tpserve:request_success_total"
    before = settled_total(served, name)
    for _ in range(8):
        client.completions.create(model="qwen2.5-7b-instruct", prompt="hi", max_tokens=1)
    assert settled_total(served, name) == before + 8


def settled_total(base: str, name: str, timeout_s: float = 20) -> float:
    """The total once six scrapes in a row (each answered by any replica) agree."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = []
        for _ in range(6):
            seen.append(scraped_total(base, name))
            time.sleep(0.3)
        if len(set(seen)) == 1 or time.monotonic() > deadline:
            assert len(set(seen)) == 1, f"scrapes disagree: {seen}"
            return seen[0]
