"""cluster/options.py: the CLI and a config file's args are generated from the ``option`` fields
of ``EngineConfig``, ``ServePlan`` and ``ServeConfig``, so a flag and its field cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Optional

import pytest

from cluster.app_config import ServeConfig, ServePlan
from cluster.options import Option, engine_config, field_options
from cluster.serve_config import NOT_ARGS, arg_options, plan_from_cli, serve_config_from_args
from scripts.config_doc import subcommand_parsers, tpserve_parser
from workers.config import EngineConfig
from workers.option_field import option, option_spec

OPTION_CLASSES = {"serve": (EngineConfig, ServePlan, ServeConfig), "generate": (EngineConfig,)}


def _actions(command: str) -> Dict[str, argparse.Action]:
    parser = subcommand_parsers(tpserve_parser())[command]  # no TPSERVE_* variables
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _option_fields(cls: type) -> List[dataclasses.Field]:
    return [field for field in dataclasses.fields(cls) if option_spec(field) is not None]


@pytest.mark.parametrize("command", sorted(OPTION_CLASSES))
def test_every_option_field_has_its_flag_with_the_fields_default(command):
    actions = _actions(command)
    wrong = []
    for cls in OPTION_CLASSES[command]:
        for field in _option_fields(cls):
            spec = option_spec(field)
            flag = spec.flag or "--" + field.name.replace("_", "-")
            action = actions.get(flag)
            name = f"{cls.__name__}.{field.name} ({flag})"
            if action is None:
                wrong.append(f"{name}: no such flag in tpserve {command}")
                continue
            if action.nargs == 0 and field.default is None:  # --x / --no-x, None until given
                if action.default is not None or "--no-" + flag[2:] not in action.option_strings:
                    wrong.append(f"{name}: a tri-state switch without --no-{flag[2:]} or with "
                                 f"a default")
            elif action.nargs == 0:  # a switch, False until given: it flips the field's default
                if action.default is not False or flag.startswith("--no-") != field.default:
                    wrong.append(f"{name}: a switch that does not flip the field's default "
                                 f"{field.default!r}")
            elif action.default != field.default:
                wrong.append(f"{name}: the flag defaults to {action.default!r}, the field to "
                             f"{field.default!r}")
            if action.help != spec.help or action.choices != spec.choices:
                wrong.append(f"{name}: help or choices differ from the field's metadata")
    assert wrong == []


def test_no_options_give_the_dataclasses_defaults():
    parser = tpserve_parser()
    serve = parser.parse_args(["serve"])
    assert plan_from_cli(serve, engine_config(serve)) == ServePlan(ServeConfig(EngineConfig()))
    generate = parser.parse_args(["generate", "--prompt", "hi"])
    assert engine_config(generate) == EngineConfig()
    assert serve_config_from_args({}, {}) == ServeConfig(EngineConfig())


def test_flags_reach_their_fields():
    parser = tpserve_parser()
    args = parser.parse_args(["serve", "--tp", "2", "--kv-blocks", "64", "--no-prefix-cache",
                              "--enforce-eager", "--groups", "1:3", "--host", "0.0.0.0",
                              "--port", "9001", "--placement", "serve", "--api-key", "k"])
    plan = plan_from_cli(args, engine_config(args))
    engine = plan.config.engine
    assert (engine.tp_size, engine.num_kv_blocks) == (2, 64)
    assert not engine.enable_prefix_cache and engine.enforce_eager
    assert (plan.config.min_groups, plan.config.max_groups) == (1, 3)
    assert (plan.host, plan.port, plan.config.placement) == ("0.0.0.0", 9001, "serve")
    assert plan.config.api_key == "k"
    assert not serve_config_from_args({"no_prefix_cache": True}, {}).engine.enable_prefix_cache


def test_generates_seed_seeds_the_engine():
    parser = tpserve_parser()
    assert engine_config(parser.parse_args(["generate", "--prompt", "x", "--seed", "5"])).seed == 5
    assert engine_config(parser.parse_args(["generate", "--prompt", "x"])).seed == 0


def test_the_api_key_defaults_to_its_environment_variable(monkeypatch):
    from cluster.cli.main import build_parser

    monkeypatch.setenv("TPSERVE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"


def test_a_config_files_args_are_the_serve_options_less_those_it_keeps_elsewhere():
    dests = {action.dest for flag, action in _actions("serve").items() if flag.startswith("--")}
    cli_only = {"help", "address", "grpc_port", "config"}
    assert set(arg_options()) == dests - cli_only - set(NOT_ARGS)


def test_an_option_field_of_another_type_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Odd:
        sizes: Optional[List[int]] = option(None, "sizes")

    with pytest.raises(TypeError, match=r"Odd.sizes: an option field must be int, float, str"):
        field_options(Odd)


def test_a_switch_flips_its_fields_default():
    on = Option("--x", bool, default=False, help="")
    off = Option("--no-x", bool, default=True, help="")
    assert (on.field_value(False), on.field_value(True)) == (False, True)
    assert (off.field_value(False), off.field_value(True)) == (True, False)
    assert on.parsed_default() is False and off.parsed_default() is False


def test_a_tristate_switch_is_none_until_given_either_way():
    parser = tpserve_parser()
    for argv, want in (([], None), (["--async-scheduling"], True),
                       (["--no-async-scheduling"], False)):
        assert engine_config(parser.parse_args(["serve", *argv])).async_scheduling is want
    for value in (True, False):
        config = serve_config_from_args({"async_scheduling": value}, environ={})
        assert config.engine.async_scheduling is value
    with pytest.raises(ValueError, match=r"args.async_scheduling: expected true or false"):
        serve_config_from_args({"async_scheduling": "yes"}, environ={})
