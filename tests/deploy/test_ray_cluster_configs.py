"""deploy/ray/cluster*.yaml are valid `ray up` configs: against the cluster-config JSON schema the
`ray` package ships, then through Ray's own preparation and validation (what `ray up` runs before
it launches anything), with the fields tpserve relies on checked by name."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {name: REPO / "deploy" / "ray" / name for name in ("cluster.yaml", "cluster-local.yaml")}


def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def load(name: str) -> dict:
    return yaml.safe_load(CONFIGS[name].read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_validates_against_rays_cluster_schema(name):
    jsonschema.validate(load(name), ray_schema())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ray_prepares_and_validates_the_config_as_ray_up_does(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(load(name))
    validate_config(prepared)
    for node_type in prepared["available_node_types"].values():
        assert node_type["min_workers"] <= node_type["max_workers"]


def test_the_schema_catches_a_broken_config():
    """The check can fail: a node type without resources, and a GPU count that is no integer."""
    config = load("cluster.yaml")
    broken = copy.deepcopy(config)
    del broken["available_node_types"]["gpu-a10g-x4"]["resources"]
    with pytest.raises(jsonschema.ValidationError, match="resources"):
        jsonschema.validate(broken, ray_schema())
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu-a10g-x4"]["resources"]["GPU"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, ray_schema())


def test_gpu_cluster_head_has_no_gpus_and_workers_scale_between_bounds():
    config = load("cluster.yaml")
    head = config["available_node_types"][config["head_node_type"]]
    assert "GPU" not in head["resources"]
    assert any("--num-gpus=0" in cmd for cmd in config["head_start_ray_commands"])
    gpu_types = [t for t in config["available_node_types"].values()
                 if t["resources"].get("GPU", 0) > 0]
    assert len(gpu_types) == 1
    workers = gpu_types[0]
    assert 1 <= workers["min_workers"] < workers["max_workers"] <= config["max_workers"]
    assert any("/mnt/nvme" in cmd for cmd in workers["initialization_commands"])


@pytest.mark.parametrize("name", ["cluster-local.yaml"])  # cluster.yaml: the image holds tpserve
def test_tpserve_is_installed_and_the_disk_tier_is_on_nvme(name):
    config = load(name)
    assert any("pip install" in cmd and "$HOME/tpserve" in cmd for cmd in setup_commands(config))
    assert config["file_mounts"]["~/tpserve"] == "./"
    serve_args = yaml.safe_load((REPO / "deploy" / "ray" / "serve.yaml").read_text())
    disk_dir = serve_args["applications"][0]["args"]["disk_kv_dir"]
    assert disk_dir.startswith("/mnt/nvme/")
    commands = (config["setup_commands"]
                + [c for t in config.get("available_node_types", {}).values()
                   for c in t.get("initialization_commands", [])])
    assert any(disk_dir in cmd for cmd in commands)


def setup_commands(config: dict) -> list:
    return [cmd for key in ("setup_commands", "head_setup_commands", "worker_setup_commands")
            for cmd in config.get(key, [])]


@pytest.mark.parametrize("name", ["cluster-local.yaml"])
def test_editable_installs_resolve_the_mounted_checkout_in_a_shell(name, tmp_path):
    """Each `pip install -e` setup command, run by bash as `ray up` runs it, with HOME holding
    the checkout where file_mounts puts it (~/tpserve): pip must find the project there. A
    dry run without the index or dependencies: nothing is downloaded or installed."""
    (tmp_path / "tpserve").symlink_to(REPO)
    commands = [c for c in setup_commands(load(name)) if "pip install" in c and " -e " in c]
    assert commands, f"{name} installs no editable tpserve"
    env = {**os.environ, "HOME": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands:
        if sys.prefix != sys.base_prefix:  # pip refuses --user inside the tests' virtualenv
            command = " ".join(word for word in shlex.split(command, posix=False)
                               if word != "--user")
        dry_run = (f"{command} --dry-run --no-deps --no-build-isolation --no-index "
                   f"--ignore-installed --report -")
        done = subprocess.run(["bash", "-c", dry_run], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{name}: {command}\n{done.stderr}"
        [install] = json.loads(done.stdout)["install"]
        assert install["metadata"]["name"] == "tpserve"
        assert install["download_info"] == {"url": (tmp_path / "tpserve").as_uri(),
                                            "dir_info": {"editable": True}}


def test_aws_cluster_runs_the_image_and_installs_nothing_of_tpserve():
    """cluster.yaml runs deploy/docker's image on every node (the tag of the chart's image and of
    the package's version), with the GPUs, the checkpoint and the NVMe tier mounted into it."""
    config = load("cluster.yaml")
    docker = config["docker"]
    name, tag = docker["image"].rsplit(":", 1)
    chart = yaml.safe_load((REPO / "helm" / "tpserve" / "values.yaml").read_text())
    app_version = yaml.safe_load((REPO / "helm" / "tpserve" / "Chart.yaml").read_text())[
        "appVersion"]
    chart_tag = chart["image"]["tag"] or app_version  # the chart's empty tag: its appVersion
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert name.endswith("/tpserve") and tag == chart_tag == version.group(1)
    assert "--gpus all" in docker["worker_run_options"]
    assert "--volume /models:/models" in docker["run_options"]
    assert "--volume /mnt/nvme:/mnt/nvme" in docker["worker_run_options"]
    assert not any("pip install" in cmd and "tpserve" in cmd for cmd in setup_commands(config))
    assert "~/tpserve" not in config["file_mounts"]
    disk_dir = yaml.safe_load((REPO / "deploy" / "ray" / "serve.yaml").read_text())[
        "applications"][0]["args"]["disk_kv_dir"]
    workers = config["available_node_types"]["gpu-a10g-x4"]
    assert any(disk_dir in cmd and "1000:1000" in cmd for cmd in workers["initialization_commands"])
    for node_type in config["available_node_types"].values():
        assert any("/models" in cmd and "1000:1000" in cmd
                   for cmd in node_type["initialization_commands"])


def test_aws_nodes_boot_a_current_deep_learning_base_ami():
    """Not `latest_dlami` (Ray resolves it to an Ubuntu 18.04 AMI whose glibc current torch
    wheels cannot run on): AWS's Deep Learning Base AMI with NVIDIA's driver on Ubuntu 24.04, by
    its SSM parameter, or a pinned id."""
    ssm = ("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
           "base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id")
    config = load("cluster.yaml")
    images = {t["node_config"]["ImageId"] for t in config["available_node_types"].values()}
    assert len(images) == 1, f"head and workers boot different AMIs: {images}"
    [image] = images
    assert image == ssm or re.fullmatch(r"ami-[0-9a-f]{8,17}", image), image


def test_local_cluster_nodes_start_ray_with_serves_transport():
    """The on-prem hosts run no image: each `ray start` exports what the image's ENV sets."""
    from cluster.cli.serve import SERVE_TRANSPORT_ENV

    config = load("cluster-local.yaml")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        [start] = [cmd for cmd in config[key] if "ray start" in cmd]
        exports = re.match(r"export ([^;]*);", start)
        assert exports, f"{key}: {start}"
        for name, value in SERVE_TRANSPORT_ENV.items():
            assert f"{name}={value}" in exports.group(1).split(), key


def test_local_cluster_lists_its_hosts_and_keeps_them_all():
    config = load("cluster-local.yaml")
    provider = config["provider"]
    assert provider["type"] == "local" and provider["head_ip"]
    assert len(provider["worker_ips"]) == config["max_workers"]
    assert any("--num-gpus=0" in cmd for cmd in config["head_start_ray_commands"])
    from ray.autoscaler._private.util import prepare_config

    # The local provider has one node type for the head and the workers alike.
    (node_type,) = prepare_config(config)["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(provider["worker_ips"])
