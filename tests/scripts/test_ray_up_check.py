"""scripts/ray_up_check.py's cheap parts: its arguments, the refusal on a machine that cannot run
it, the copies of the shipped YAMLs it deploys (only the fields a user edits are replaced, and
they pass Ray's own validation), the hosts' names and boot script. The end-to-end run itself
(`python -m scripts.ray_up_check`, minutes) is not part of the suite: docs/deployment.md."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from bench_scripts import load_script, run_script

from scripts.ray_up import configs, hosts, preflight

FIELDS = configs.ClusterFields(cluster_name="c1", head_ip="10.77.5.10", worker_ips=["10.77.5.11"],
                               ssh_user="root", ssh_private_key="/k/id", key_dir="/k/tpserve")


@pytest.fixture(scope="module")
def check():
    return load_script("ray_up_check")


def test_arguments_are_checked_naming_the_bad_one(check, tmp_path, capsys):
    args = check.parse_args([])
    assert args.model == "default" and not args.keep and args.workdir_root == Path("/var/tmp")
    for argv, named in ((["--timeout-s", "0"], "--timeout-s 0"),
                        (["--model", str(tmp_path)], f"--model {tmp_path}"),
                        (["--workdir-root", "/tmp/x"], "--workdir-root /tmp/x")):
        with pytest.raises(SystemExit) as exit_info:
            check.parse_args(argv)
        assert exit_info.value.code == 2
        assert named in capsys.readouterr().err


def test_refusal_names_every_missing_piece():
    machine = preflight.Machine(euid=lambda: 1000,
                                which=lambda name: None if name in ("sshd", "rsync") else name)
    found = preflight.problems(machine)
    assert len(found) == 3
    assert "root" in found[0] and "uid 1000" in found[0]
    assert any("openssh-server" in item for item in found)
    assert any("`rsync`" in item for item in found)
    assert preflight.problems(preflight.Machine(euid=lambda: 0, which=lambda n: n)) == []
    assert "cannot run on this machine" in preflight.refusal(found)


def test_the_script_refuses_with_status_2_before_making_anything(check, monkeypatch, capsys):
    done = run_script("ray_up_check", "--help", timeout=60)
    assert done.returncode == 0 and "--keep" in done.stdout
    monkeypatch.setattr(check.preflight, "problems", lambda: ["no `sshd` command: install it"])
    monkeypatch.setattr(check.tempfile, "mkdtemp", lambda **_: pytest.fail("made a folder"))
    assert check.main([]) == 2
    assert "cannot run on this machine:\n  - no `sshd` command" in capsys.readouterr().err


def test_cluster_copy_changes_only_the_fields_users_edit():
    shipped = configs.load(configs.CLUSTER_YAML)
    before = copy.deepcopy(shipped)
    made = configs.cluster_config(shipped, FIELDS)
    assert shipped == before
    assert made["provider"] == {"type": "local", "head_ip": "10.77.5.10",
                                "worker_ips": ["10.77.5.11"]}
    assert made["auth"] == {"ssh_user": "root", "ssh_private_key": "/k/id"}
    assert made["max_workers"] == 1 and made["cluster_name"] == "c1"
    assert made["file_mounts"] == {**shipped["file_mounts"], "~/.tpserve": "/k/tpserve"}
    changed = {key for key in shipped if shipped[key] != made[key]}
    assert changed == {"cluster_name", "provider", "auth", "max_workers", "file_mounts"}


def test_cluster_copy_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(configs.cluster_config(configs.load(configs.CLUSTER_YAML),
                                                          FIELDS)))


def test_bad_cluster_fields_are_refused_by_name():
    with pytest.raises(ValueError, match="worker_ips"):
        configs.ClusterFields("c", "10.0.0.1", [], "u", "k", "d")
    with pytest.raises(ValueError, match="head_ip 10.0.0.1 is also in worker_ips"):
        configs.ClusterFields("c", "10.0.0.1", ["10.0.0.1"], "u", "k", "d")
    shipped = configs.load(configs.CLUSTER_YAML)
    del shipped["file_mounts"]["~/.tpserve"]
    with pytest.raises(ValueError, match="file_mounts: expected ~/.tpserve"):
        configs.cluster_config(shipped, FIELDS)


def test_serve_copy_sets_model_sizes_and_key_source_and_parses():
    from cluster.serve_config import arg_options

    shipped = configs.load(configs.SERVE_YAML)
    sizes = {"tp": 3, "groups": "1", "device": "cpu", "placement_strategy": "SPREAD"}
    made = configs.serve_config(shipped, configs.ServeFields(
        model="/mnt/models/m", served_model_name="m", sizes=sizes, api_key="env:KEY"))
    args = made["applications"][0]["args"]
    assert args["model"] == "/mnt/models/m" and args["api_key_env"] == "KEY"
    assert {key: args[key] for key in sizes} == sizes
    old = shipped["applications"][0]["args"]
    mine = (*sizes, "model", "served_model_name", "api_key_env", "api_key_file")
    assert {k: v for k, v in args.items() if k not in mine} == \
        {k: v for k, v in old.items() if k not in mine}
    assert "api_key_file" not in args  # one source: the file's own gave way to the variable
    assert set(args) - {"api_key_env"} <= set(arg_options())
    assert made["http_options"] == shipped["http_options"]
    as_file = configs.serve_config(shipped, configs.ServeFields(model="m", served_model_name="m"))
    assert as_file["applications"][0]["args"]["api_key_file"] == "~/.tpserve/api_key"
    assert "api_key_env" not in as_file["applications"][0]["args"]


def test_bad_serve_fields_are_refused_by_name():
    with pytest.raises(ValueError, match="sizes: model are not size args"):
        configs.ServeFields(model="m", served_model_name="m", sizes={"model": "x"})
    with pytest.raises(ValueError, match="api_key 'key': expected 'file' or 'env:NAME'"):
        configs.ServeFields(model="m", served_model_name="m", api_key="key")


def test_written_copy_reads_back(tmp_path):
    made = configs.cluster_config(configs.load(configs.CLUSTER_YAML), FIELDS)
    path = configs.write(made, tmp_path / "c.yaml", header="a copy")
    assert path.read_text().startswith("# a copy\n") and yaml.safe_load(path.read_text()) == made


def test_hosts_get_unique_names_and_a_free_subnet(tmp_path):
    routes = "10.77.8.0/24 dev x\n10.77.9.0/24 dev y\n"
    network = hosts.plan_network(7, ["head", "worker"], tmp_path, routes)
    assert network.gateway == "10.77.10.1" and network.bridge == "tpsrb7"
    assert [h.address for h in network.hosts] == ["10.77.10.10", "10.77.10.11"]
    names = [n for h in network.hosts for n in (h.netns, h.veth)] + [network.bridge]
    assert len(set(names)) == len(names) and max(map(len, names)) <= 15  # IFNAMSIZ - 1
    assert hosts.free_subnet(249, "") == "10.77.250"


def test_boot_script_binds_the_model_before_covering_root(tmp_path):
    (host,) = hosts.plan_network(1, ["head"], tmp_path, "").hosts
    script = hosts.boot_script(host, Path("/root/.cache/m"))
    lines = script.splitlines()
    model = lines.index("mount --bind /root/.cache/m /mnt/models/m")
    assert lines.index(f"mount --bind {host.root / 'mnt'} /mnt") < model
    assert model < lines.index(f"mount --bind {host.home} /root")
    assert lines[-1].startswith("exec /usr/sbin/sshd -D") and "hostname tpsr-1-head" in lines
    assert f"ListenAddress {host.address}" in hosts.sshd_config(host)


def test_shipped_cluster_local_keeps_what_the_real_run_needed():
    """Each fix the first real `ray up` needed (docs/deployment.md#on-prem-hosts), by name."""
    config = configs.load(configs.CLUSTER_YAML)
    setup = config["setup_commands"]
    assert not any("--user" in cmd for cmd in setup), "PEP 668: system pip refuses --user"
    assert any("python3 -m venv ~/tpserve-venv" in cmd for cmd in setup)
    path_line = next(cmd for cmd in setup if "~/.bashrc" in cmd)
    assert 'export PATH="$HOME/tpserve-venv/bin:$PATH"' in path_line  # ray on PATH for Ray's shell
    assert setup.index(path_line) < next(i for i, c in enumerate(setup) if "pip install" in c)
    assert "RAY_enable_autoscaler_v2=0" in " ".join(config["head_start_ray_commands"])
    assert config["file_mounts"][configs.REMOTE_KEY_DIR] == "~/.tpserve"
    assert config["file_mounts_sync_continuously"] is True  # a rotated key reaches the workers
