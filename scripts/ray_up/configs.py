"""The copies of deploy/ray/cluster-local.yaml and deploy/ray/serve.yaml that a check (or a user)
deploys: the shipped files with only the fields their comments say to edit replaced. Pure
functions: a loaded YAML mapping in, a new mapping out; the shipped mapping is never changed."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "deploy" / "ray" / "cluster-local.yaml"
SERVE_YAML = REPO / "deploy" / "ray" / "serve.yaml"
# cluster-local.yaml's file_mounts copy this folder to every node; the API key is a file in it
# (never in a YAML). A folder, not the file: Ray re-syncs a changed folder on `ray up`.
REMOTE_KEY_DIR = "~/.tpserve"
REMOTE_API_KEY = f"{REMOTE_KEY_DIR}/api_key"
# The serve.yaml args that size the deployment for one host's hardware.
SIZE_ARGS = ("tp", "groups", "device", "kv_cache_gb", "max_model_len", "host_kv_gb",
             "disk_kv_gb", "placement_strategy")


@dataclass(frozen=True)
class ClusterFields:
    """cluster-local.yaml's fields that name the user's hosts, login and key."""

    cluster_name: str
    head_ip: str
    worker_ips: Sequence[str]
    ssh_user: str
    ssh_private_key: str
    key_dir: str  # the local folder that file_mounts copies to REMOTE_KEY_DIR (api_key in it)

    def __post_init__(self) -> None:
        if not self.worker_ips:
            raise ValueError("worker_ips: expected at least one worker host, got none")
        if self.head_ip in self.worker_ips:
            raise ValueError(f"head_ip {self.head_ip} is also in worker_ips; expected "
                             f"distinct hosts")


@dataclass(frozen=True)
class ServeFields:
    """serve.yaml's fields that say what to serve and how large, for the hosts at hand."""

    model: str
    served_model_name: str
    sizes: Mapping[str, Any] = field(default_factory=dict)  # SIZE_ARGS keys only
    api_key: str = "file"  # "file": api_key_file REMOTE_API_KEY; "env:NAME": api_key_env NAME

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sizes) - set(SIZE_ARGS))
        if unknown:
            raise ValueError(f"sizes: {', '.join(unknown)} are not size args; expected some "
                             f"of {', '.join(SIZE_ARGS)}")
        if self.api_key != "file" and not self.api_key.startswith("env:"):
            raise ValueError(f"api_key {self.api_key!r}: expected 'file' or 'env:NAME'")


def load(path: Path) -> Dict[str, Any]:
    return yaml.safe_load(path.read_text())


def cluster_config(shipped: Mapping[str, Any], fields: ClusterFields) -> Dict[str, Any]:
    """cluster-local.yaml with the user's hosts, login, key and API key folder; everything else,
    the setup and start commands included, as shipped."""
    config = copy.deepcopy(dict(shipped))
    if REMOTE_KEY_DIR not in config.get("file_mounts", {}):
        raise ValueError(f"file_mounts: expected {REMOTE_KEY_DIR} (the API key's folder, copied "
                         f"to every node), found {sorted(config.get('file_mounts', {}))}")
    config["cluster_name"] = fields.cluster_name
    config["provider"] = {**config["provider"], "head_ip": fields.head_ip,
                          "worker_ips": list(fields.worker_ips)}
    config["auth"] = {**config["auth"], "ssh_user": fields.ssh_user,
                      "ssh_private_key": fields.ssh_private_key}
    config["max_workers"] = len(fields.worker_ips)
    config["file_mounts"] = {**config["file_mounts"], REMOTE_KEY_DIR: fields.key_dir}
    return config


def serve_config(shipped: Mapping[str, Any], fields: ServeFields) -> Dict[str, Any]:
    """serve.yaml with the model, its name, the sizes and the API key's source replaced."""
    config = copy.deepcopy(dict(shipped))
    (app,) = config["applications"]
    args = dict(app["args"])
    for key in ("api_key_env", "api_key_file"):
        args.pop(key, None)
    args.update(model=fields.model, served_model_name=fields.served_model_name, **fields.sizes)
    if fields.api_key == "file":
        args["api_key_file"] = REMOTE_API_KEY
    else:
        args["api_key_env"] = fields.api_key.removeprefix("env:")
    app["args"] = args
    return config


def write(config: Mapping[str, Any], path: Path, header: Optional[str] = None) -> Path:
    text = yaml.safe_dump(dict(config), sort_keys=False)
    path.write_text((f"# {header}\n" if header else "") + text)
    return path
