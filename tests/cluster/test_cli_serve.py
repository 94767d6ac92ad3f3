"""`tpserve serve` refuses a configuration the model cannot take before it starts anything.

The refusals run the console script's entry point (`cluster.cli.main.main`) in this process, which
also shows that no Ray was started for them; the failed deploy runs it as a subprocess."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def serve(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", "serve", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def refused(capsys, *args):
    """``tpserve serve *args`` in this process: its exit code, stdout and stderr; fails the test
    if it started Ray (a refusal must come before anything is started)."""
    import ray

    from cluster.cli.main import main

    assert not ray.is_initialized()
    try:
        code = main(["serve", *args])
    finally:
        started_ray = ray.is_initialized()
        if started_ray:
            ray.shutdown()
    assert not started_ray, "Ray was started before the configuration was refused"
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("args,words", [
    (("--tp", "3"), "tensor-parallel size 3 does not divide the model's 4 attention heads"),
    (("--max-model-len", "100000"), "exceeds the model's max_position_embeddings (256)"),
])
def test_a_configuration_the_model_cannot_take_exits_before_deploying(tiny_llama, capsys, args,
                                                                      words):
    code, out, err = refused(capsys, "--model", str(tiny_llama), "--port", "0", *args)
    assert code == 2 and words in err, err[-2000:]
    assert "serving on" not in out


def test_a_missing_checkpoint_exits_before_deploying(tmp_path, capsys):
    code, _, err = refused(capsys, "--model", str(tmp_path / "nope"), "--port", "0")
    assert code == 2 and "nope" in err


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_deploy_that_serve_gives_up_on_exits_1_saying_why(tiny_llama, tmp_path):
    """Shards that exist but cannot be read pass the up-front check; every group replica then
    fails to load them, Serve marks the application DEPLOY_FAILED, and the CLI says so."""
    import shutil

    from cluster.ports import free_port

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    # Serve gives up after one failed start of the replica instead of its default three: the
    # same path to DEPLOY_FAILED.
    env = {**os.environ, "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"}
    result = serve("--model", str(broken), "--port", str(free_port()), timeout=240, env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "the application failed to deploy" in result.stderr
    assert "serving on" not in result.stdout


def test_a_context_the_kv_pool_cannot_hold_exits_before_deploying(tiny_llama, capsys):
    code, _, err = refused(capsys, "--model", str(tiny_llama), "--port", "0", "--block-size", "4",
                           "--kv-blocks", "8", "--max-model-len", "64")
    assert code == 2 and "--max-model-len 64 does not fit" in err


KEEP_OFF = """
import json, os
from cluster.app_config import ServeConfig
from cluster.cli.serve import keep_off_rank_cores
from workers.config import EngineConfig
keep_off_rank_cores(ServeConfig(engine=EngineConfig(**{engine}), max_groups={groups}))
print(json.dumps({{"cpus": sorted(os.sched_getaffinity(0)),
                  "node": os.environ.get("TPSERVE_NODE_CPUS")}}))
"""


def keep_off(tmp_path, groups=1, node_cpus=None, **engine):
    """`keep_off_rank_cores` in a child process (it pins the process that calls it)."""
    import json
    import os

    env = {**os.environ, "TPSERVE_CORE_REGISTRY": str(tmp_path / "cores.json")}
    env.pop("TPSERVE_NODE_CPUS", None)
    if node_cpus is not None:
        env["TPSERVE_NODE_CPUS"] = node_cpus
    proc = subprocess.run([sys.executable, "-c", KEEP_OFF.format(engine=engine, groups=groups)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_local_ray_starts_on_the_cores_the_cpu_ranks_leave(tmp_path):
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("binding leaves a core free: needs two")
    out = keep_off(tmp_path, device="cpu")
    assert out["cpus"] == cpus[1:]  # the first core is the rank's to claim
    assert out["node"] == ",".join(map(str, cpus))  # which the ranks claim from
    # ranks that could not all claim a core, binding off, or CUDA: Ray keeps every core
    for groups, engine in ((len(cpus), {"device": "cpu"}),
                           (1, {"device": "cpu", "cpu_binding": "none"}),
                           (1, {"device": "cuda"})):
        assert keep_off(tmp_path, groups, **engine) == {"cpus": cpus, "node": None}
    absent = max(cpus) + 1000  # cores this process may not run on: a warning, Ray unpinned
    assert keep_off(tmp_path, node_cpus=f"{absent}-{absent + 1}", device="cpu") == \
        {"cpus": cpus, "node": f"{absent}-{absent + 1}"}


def test_the_local_ray_gets_serves_transport_unless_the_user_set_it(monkeypatch):
    import os

    from cluster.cli.serve import SERVE_TRANSPORT_ENV, use_serve_transport

    assert SERVE_TRANSPORT_ENV == {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
    monkeypatch.delenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", raising=False)
    use_serve_transport()
    assert os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
    monkeypatch.setenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", "0")  # the object store, the user's
    use_serve_transport()
    assert os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "0"
