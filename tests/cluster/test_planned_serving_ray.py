"""Serving groups placed by the topology plan, on a two-node `ray.cluster_utils.Cluster` with fake
GPUs and different real topologies: node "pcie" reads a 2-GPU PCIe (PHB) `nvidia-smi topo -m`,
node "nvlink" an 8-GPU NV18 H100 one of which Ray offers 2 GPUs. TP 2 plans two groups: the
NV18 pair on "nvlink" first, then the PHB pair on "pcie".

The ranks compute on CPU (`device="cpu"`: fake GPUs run no CUDA) while carrying the plan's
`CUDA_VISIBLE_DEVICES`; each rank reports its Ray node and that variable itself. The load that
scales the deployment is real HTTP traffic through the OpenAI client.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from cluster.app import ServeConfig, build_app  # noqa: E402
from cluster.cli.status import collect_status  # noqa: E402
from cluster.ports import free_port  # noqa: E402
from parallel.topology_probe import IBSTAT_FILE_ENV, NVSMI_FILE_ENV  # noqa: E402
from ray_clusters import loopback_cluster  # noqa: E402
from test_serve_e2e import API_KEY  # noqa: E402
from workers.config import EngineConfig  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "topology"
PCIE = {NVSMI_FILE_ENV: str(DATA / "nvidia-smi-topo_pcie2_phb.txt"),
        IBSTAT_FILE_ENV: str(DATA / "ibstat_a100_all_active.txt")}
NVLINK = {NVSMI_FILE_ENV: str(DATA / "nvidia-smi-topo_h100x8_nv18_12nic.txt"),
          IBSTAT_FILE_ENV: str(DATA / "ibstat_h100_all_active.txt")}
PROMPT = list(range(5, 65))  # 60 tokens + 60 generated: 30 of a group's 32 KV blocks


def wait_for(what, predicate, timeout_s: float, period_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s; status: "
                         f"{json.dumps(collect_status(), indent=1)[:3000]}")


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster([dict(num_cpus=2, num_gpus=2, env_vars=PCIE),
                           dict(num_cpus=2, num_gpus=2, env_vars=NVLINK)]) as c:
        pcie_id, nvlink_id = (node.node_id for node in (c.head_node, c.list_all_nodes()[1]))
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # Serve and the named actors end with the cluster (`loopback_cluster`).
        yield c, {"pcie": pcie_id, "nvlink": nvlink_id}, port


@pytest.fixture(scope="module")
def client(cluster, tiny_llama):
    _, _, port = cluster
    engine = EngineConfig(model=str(tiny_llama), tp_size=2, block_size=4, num_kv_blocks=32,
                          device="cpu")
    config = ServeConfig(engine=engine, min_groups=1, max_groups=3, placement="plan",
                         ingress_replicas="1",
                         api_key=API_KEY,
                         served_model_name="tiny", autoscale_look_back_s=2.0,
                         upscale_delay_s=0.0, downscale_delay_s=600.0)
    serve.run(build_app(config, ray.cluster_resources()), name="tpserve", route_prefix="/")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)


class Load:
    """`streams` client threads each sending long requests back to back until stopped."""

    def __init__(self, client, streams: int) -> None:
        self.stop, self.errors, self.done = threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._run, args=(client,)) for _ in range(streams)]
        for thread in self.threads:
            thread.start()

    def _run(self, client) -> None:
        while not self.stop.is_set():
            try:
                out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60,
                                                extra_body={"ignore_eos": True})
                self.done += out.usage.completion_tokens == 60
            except openai.APIError as exc:
                self.errors.append(exc)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


def planned(status, nodes, node_names):
    return [[{"node": nodes[name], "device": d} for d in (0, 1)] for name in node_names]


def live_groups(status) -> dict:
    """{planned group: its ranks as (node, device)} for every live replica."""
    return {g["planned_group"]: [(r["node"], int(r["device"])) for r in g["ranks"]]
            for g in status["groups"] if g["ranks"]}


def assert_every_rank_where_planned(status) -> None:
    plan = status["plan"]["groups"]
    for group in status["groups"]:
        ranks = [(r["node"], int(r["device"])) for r in group["ranks"]]
        assert ranks == [(p["node"], p["device"]) for p in plan[group["planned_group"]]]
        assert all(r["torch_device"] == "cpu" for r in group["ranks"])
        assert len({r["pid"] for r in group["ranks"]}) == 2


def test_first_replica_runs_on_the_first_planned_group(cluster, client):
    _, nodes, _ = cluster
    status = wait_for("one live group", lambda: (s := collect_status())["groups"] and s, 120)
    assert status["placement"] == "plan"
    assert status["plan"]["groups"] == planned(status, nodes, ["nvlink", "pcie"])
    assert [link["link"] for link in status["plan"]["links"]] == ["NV18", "PHB"]
    assert any("offers 2 GPU(s)" in item["reason"] for item in status["plan"]["left_out"])
    assert live_groups(status) == {0: [(nodes["nvlink"], 0), (nodes["nvlink"], 1)]}
    assert_every_rank_where_planned(status)
    assert status["unclaimed_groups"] == [1]
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_status_cli_reads_the_cluster(cluster, client):
    c, nodes, _ = cluster
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "cluster.cli.main", "status", "--address", c.address,
                           "--json"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    (group,) = data["groups"]
    assert group["ranks"][0]["node"] == nodes["nvlink"] and group["ranks"][1]["device"] == "1"
    assert {"kv_usage", "running", "waiting", "replica"} <= set(group)
    assert data["plan"]["groups"][1] == [{"node": nodes["pcie"], "device": d} for d in (0, 1)]
    assert data["plan"]["explanation"][0].startswith("group 0: ")
    plan = subprocess.run([sys.executable, "-m", "cluster.cli.main", "topology", "plan", "--address",
                           c.address, "--tp", "2", "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["groups"] == data["plan"]["groups"]


def test_load_scales_to_the_next_planned_group(cluster, client):
    _, nodes, _ = cluster
    load = Load(client, streams=1)
    try:
        status = wait_for("a second group", lambda: len(live_groups(s := collect_status())) == 2
                          and s, 180)
    finally:
        load.close()
    assert live_groups(status)[1] == [(nodes["pcie"], 0), (nodes["pcie"], 1)]
    assert_every_rank_where_planned(status)
    assert status["unclaimed_groups"] == [] and load.errors == [] and load.done >= 1


def test_killed_replica_gives_its_group_back(cluster, client):
    _, nodes, _ = cluster
    before = {g["planned_group"]: g["replica"] for g in collect_status()["groups"]}
    victim = before[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::tpserve#TPGroup#{victim}", namespace="serve"),
             no_restart=True)

    def replaced():
        status = collect_status()
        holders = {g["planned_group"]: g["replica"] for g in status["groups"]}
        return holders.get(0) not in (None, victim) and len(holders) == 2 and status

    status = wait_for("group 0 claimed by a new replica", replaced, 180)
    assert live_groups(status)[0] == [(nodes["nvlink"], 0), (nodes["nvlink"], 1)]
    assert_every_rank_where_planned(status)
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
    assert out.usage.completion_tokens == 4


def test_replica_beyond_the_plan_is_reported_then_placed_on_a_joining_node(cluster, client):
    c, nodes, _ = cluster
    load = Load(client, streams=3)
    try:
        status = wait_for("a refused replica", lambda: (s := collect_status())["errors"] and s,
                          180)
        assert_every_rank_where_planned(status)
        assert len(live_groups(status)) == 2
        assert "has no planned group: the plan has 2 group(s) of TP 2" in status["errors"][0]
        refused = status["errors"][0].split()[1]
        logs = glob.glob(os.path.join(c.head_node.get_session_dir_path(), "logs",
                                      "worker-*.err"))
        assert any(f"TP group {refused} not started: replica {refused} has no planned group"
                   in Path(log).read_text(errors="replace") for log in logs)
        # A node joins: the next replica that asks gets its group, no restart.
        joined = c.add_node(num_cpus=2, num_gpus=2, env_vars=PCIE).node_id
        status = wait_for("a third group on the new node",
                          lambda: len(live_groups(s := collect_status())) == 3 and s, 180)
    finally:
        load.close()
    assert status["plan"]["groups"][2] == [{"node": joined, "device": d} for d in (0, 1)]
    assert live_groups(status)[2] == [(joined, 0), (joined, 1)]
    assert_every_rank_where_planned(status)
    assert status["errors"] == [] and load.errors == []
