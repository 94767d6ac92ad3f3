"""The Serve config file's application args (cluster/serve_config.py) and `tpserve serve --config`:
the same options as `tpserve serve`, errors that name the key, the API key from the environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.serve_config import IMPORT_PATH, plan_from_file, serve_config_from_args

REPO = Path(__file__).resolve().parents[2]
SERVE_YAML = REPO / "deploy" / "ray" / "serve.yaml"


def test_args_build_the_config_tpserve_serve_would():
    config = serve_config_from_args(
        {"model": "/m", "tp": 4, "groups": "2:6", "kv_target_occupancy": 0.6, "host_kv_gb": 8,
         "disk_kv_dir": "/nvme", "disk_kv_gb": 100, "kv_eviction": "hotness",
         "no_prefix_cache": False, "served_model_name": "m", "api_key_env": "MY_KEY"},
        {"MY_KEY": "s3cret"})
    engine = config.engine
    assert (engine.model, engine.tp_size, engine.host_kv_gb, engine.disk_kv_dir) == (
        "/m", 4, 8.0, "/nvme")
    assert (config.min_groups, config.max_groups, config.kv_target_occupancy) == (2, 6, 0.6)
    assert config.api_key == "s3cret" and config.served_model_name == "m"
    assert engine.kv_eviction == "hotness" and engine.enable_prefix_cache


def test_defaults_are_tpserve_serves():
    config = serve_config_from_args({}, {})
    assert config.engine.model == "default" and config.engine.tp_size == 1
    assert (config.min_groups, config.max_groups, config.api_key) == (1, 1, None)


def test_the_key_file_is_read_where_the_application_is_built(tmp_path):
    """A cluster's build task has no shell of the user's: the key comes from a file there."""
    path = tmp_path / "api_key"
    path.write_text("from-file\n")
    config = serve_config_from_args({"api_key_file": str(path)}, {})
    assert config.api_key is None and config.api_key_file == str(path)
    with pytest.raises(ValueError, match=r"args.api_key_file: .*/absent: no such file on "):
        serve_config_from_args({"api_key_file": str(tmp_path / "absent")}, {})
    with pytest.raises(ValueError, match="args.api_key_env and args.api_key_file: give one"):
        serve_config_from_args({"api_key_file": str(path), "api_key_env": "K"}, {"K": "v"})


@pytest.mark.parametrize("args,words", [
    ({"tp_size": 2}, "args.tp_size: unknown key; expected one of"),
    ({"tp": "2"}, "args.tp: expected an integer, got '2'"),
    ({"tp": True}, "args.tp: expected an integer"),
    ({"groups": 64}, 'args.groups: expected a quoted string "N" or "MIN:MAX"'),
    ({"groups": "4:2"}, "args.groups must be N or MIN:MAX"),
    ({"tp": 0}, "args.tp must be at least 1"),
    ({"kv_eviction": "fifo"}, "args.kv_eviction: expected one of lru, hotness"),
    ({"no_prefix_cache": "yes"}, "args.no_prefix_cache: expected true or false"),
    ({"kv_target_occupancy": "high"}, "args.kv_target_occupancy: expected a number"),
    ({"disk_kv_dir": "/d", "disk_kv_gb": 1}, "args.disk_kv_dir needs a host tier"),
    ({"disk_kv_dir": "/a,,/b", "host_kv_gb": 1, "disk_kv_gb": 1},
     "args.disk_kv_dir '/a,,/b': entry 2 is empty"),
    ({"api_key": "s3cret"}, "args.api_key: not an application arg"),
    ({"ingress_replicas": 2}, "args.ingress_replicas: expected a string"),
    ({"ingress_replicas": "3:1"}, "args.ingress_replicas must be N or MIN:MAX with 1 <= MIN"),
    ({"ingress_replicas": "0"}, "args.ingress_replicas must be N or MIN:MAX with 1 <= MIN"),
    ({"ingress_replicas": "two"}, "args.ingress_replicas must be N or MIN:MAX, got 'two'"),
    ({"port": 9000}, "args.port: not an application arg; it comes from the file's http_options"),
    ({"api_key_env": "UNSET_VAR"},
     "args.api_key_env: the environment variable UNSET_VAR is not set"),
    ({"api_key_env": "not a name"},
     "args.api_key_env: expected the name of an environment variable"),
])
def test_bad_args_name_the_key(args, words):
    with pytest.raises(ValueError) as info:
        serve_config_from_args(args, {})
    assert words in str(info.value)


def test_the_shipped_file_is_read_as_serve_reads_it(monkeypatch, tmp_path):
    (tmp_path / ".tpserve").mkdir()
    (tmp_path / ".tpserve" / "api_key").write_text("k\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = plan_from_file(SERVE_YAML)
    assert plan.app_name == "tpserve" and (plan.host, plan.port) == ("0.0.0.0", 8000)
    assert plan.config.engine.tp_size == 2 and plan.config.api_key_file == "~/.tpserve/api_key"
    assert plan.config.engine.device == "cuda" and plan.config.engine.disk_kv_dir
    assert plan.config.ingress_replicas == "2:4"
    assert plan.grpc_options["port"] == 9000
    assert IMPORT_PATH in SERVE_YAML.read_text()
    monkeypatch.setenv("HOME", str(tmp_path / "nobody"))
    with pytest.raises(ValueError, match="args.api_key_file: ~/.tpserve/api_key: no such file"):
        plan_from_file(SERVE_YAML)


def write_config(tmp_path, args, **top):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({**top, "applications": [
        {"name": "llm", "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}]}))
    return path


def test_a_file_without_a_tpserve_application_is_refused(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"import_path": "app:main"}]}))
    with pytest.raises(ValueError, match="expected one application with import_path"):
        plan_from_file(path)
    path.write_text("applications: [oops")
    with pytest.raises(ValueError, match="not valid YAML"):
        plan_from_file(path)


def run_cli(capsys, *args):
    """`tpserve serve ...` through the CLI's entry point (each case fails before Ray starts)."""
    from cluster.cli.main import main

    code = main(["serve", *args])
    return code, capsys.readouterr().err


def test_cli_config_with_a_bad_key_exits_2_naming_it(tmp_path, capsys):
    code, err = run_cli(capsys, "--config",
                        str(write_config(tmp_path, {"model": "default", "tpp": 2})))
    assert code == 2 and "args.tpp: unknown key" in err and "Traceback" not in err


def test_cli_config_refuses_options_beside_the_file(tmp_path, capsys):
    code, err = run_cli(capsys, "--config", str(write_config(tmp_path, {})), "--tp", "2")
    assert code == 2 and "--tp: not allowed with --config" in err


def test_cli_config_checks_the_model_before_starting_ray(tiny_llama, tmp_path, capsys):
    code, err = run_cli(capsys, "--config",
                        str(write_config(tmp_path, {"model": str(tiny_llama), "tp": 3})))
    assert code == 2
    assert "tensor-parallel size 3 does not divide the model's 4 attention heads" in err
    import ray

    assert not ray.is_initialized()


def test_the_tpserve_console_script_takes_config(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cluster.cli.main", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0 and "--config" in result.stdout


def test_the_placement_strategy_is_an_arg_and_an_option():
    config = serve_config_from_args({"placement_strategy": "STRICT_PACK"}, {})
    assert config.placement_strategy == "STRICT_PACK"
    assert serve_config_from_args({}, {}).placement_strategy is None  # PACK, as Serve LLM
    with pytest.raises(ValueError, match="args.placement_strategy: expected one of PACK"):
        serve_config_from_args({"placement_strategy": "pack"}, {})


def test_request_chat_templates_are_trusted_only_when_asked():
    """--trust-request-chat-template (trust_request_chat_template in a file's args) reaches
    the ingress's limits; without it a request's chat template is refused."""
    from cluster.app import request_limits
    from cluster.cli.main import build_parser
    from cluster.cli.generate import engine_config
    from cluster.serve_config import plan_from_cli

    def trusted(config):
        return request_limits(config)[2].trust_request_chat_template

    assert not trusted(serve_config_from_args({}, {}))
    assert trusted(serve_config_from_args({"trust_request_chat_template": True}, {}))
    with pytest.raises(ValueError, match="args.trust_request_chat_template: expected true"):
        serve_config_from_args({"trust_request_chat_template": "yes"}, {})
    for argv, expected in [([], False), (["--trust-request-chat-template"], True)]:
        args = build_parser().parse_args(["serve", *argv])
        assert trusted(plan_from_cli(args, engine_config(args)).config) is expected
