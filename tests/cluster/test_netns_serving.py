"""Separate hosts: two network namespaces joined by a veth pair, a Ray head in one and a worker
in the other on their own addresses, and one TP 2 group whose ranks sit in both (placed by the
topology plan, gloo over the veth with each rank's `GLOO_SOCKET_IFNAME` from the plan's probe of
its node). Greedy output equals transformers'; then the worker namespace's Ray is killed and the
group's health check fails within a minute.

Needs root and `ip netns` (skipped, saying why, where either is missing). The namespaces, and
every process in them, are removed whatever happens; no `ray stop` (it would stop every Ray on
the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_models import hf_greedy

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROMPTS = [[5, 6, 7, 8], [11, 3, 9]]
MAX_NEW = 8


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_unavailable() -> str:
    if shutil.which("ip") is None:
        return "no `ip` command"
    if os.geteuid() != 0:
        return "needs root for `ip netns`"
    probe = f"tps-probe-{os.getpid()}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


def _kill_namespace(ns: str) -> None:
    done = _ip("netns", "pids", ns, check=False)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", ns, check=False)


@pytest.fixture
def two_hosts():
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    tag = os.getpid() % 10000
    subnet = f"10.77.{tag % 250}"
    hosts = {"head": (f"tps-h{tag}", f"tpsh{tag}", f"{subnet}.1"),
             "worker": (f"tps-w{tag}", f"tpsw{tag}", f"{subnet}.2")}
    try:
        for ns, _, _ in hosts.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        (h_ns, h_if, _), (w_ns, w_if, _) = hosts["head"], hosts["worker"]
        _ip("link", "add", h_if, "netns", h_ns, "type", "veth", "peer", "name", w_if,
            "netns", w_ns)
        for ns, ifname, address in hosts.values():
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
        yield hosts
    finally:
        for ns, _, _ in hosts.values():
            _kill_namespace(ns)


def _in_ns(ns: str, argv: list, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(["ip", "netns", "exec", ns, *argv], env=env, capture_output=True,
                          text=True, **kwargs)


def test_group_spanning_two_namespaces(two_hosts, tiny_llama, tmp_path):
    (h_ns, h_if, h_ip), (w_ns, w_if, w_ip) = two_hosts["head"], two_hosts["worker"]
    address = f"{h_ip}:6379"
    ray_cli = str(BIN / "ray")
    head = _in_ns(h_ns, [ray_cli, "start", "--head", f"--node-ip-address={h_ip}", "--port=6379",
                         "--num-cpus=1", "--include-dashboard=false"], timeout=120)
    assert head.returncode == 0, head.stderr[-2000:]
    worker = _in_ns(w_ns, [ray_cli, "start", f"--address={address}",
                           f"--node-ip-address={w_ip}", "--num-cpus=1"], timeout=120)
    assert worker.returncode == 0, worker.stderr[-2000:]
    expected = tmp_path / "expected.json"
    want = hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    expected.write_text(json.dumps({"prompts": PROMPTS, "max": MAX_NEW}))
    started = time.monotonic()
    driver = _in_ns(h_ns, [sys.executable, str(REPO / "tests" / "cluster" / "netns_driver.py"),
                           address, h_ip, str(tiny_llama), str(expected), w_ns], timeout=240)
    assert driver.returncode == 0, (driver.stdout[-2000:], driver.stderr[-4000:])
    result = json.loads(driver.stdout.strip().splitlines()[-1])
    assert result["texts"] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in want]
    # One rank in each namespace, each on its own interface, as the plan's probe found it.
    assert sorted((r["ip"], r["socket_ifname"]) for r in result["ranks"]) == sorted(
        [(h_ip, h_if), (w_ip, w_if)])
    (group,) = result["plan"]["groups"]
    assert len({rank["node"] for rank in group}) == 2 and result["plan"]["device_kind"] == "cpu"
    print(f"netns: health check failed {result['health_failed_after_s']:.1f} s after the worker "
          f"namespace's Ray was killed; ranks {result['ranks']}")
    assert result["health_failed_after_s"] < 60, result
    assert time.monotonic() - started < 240
