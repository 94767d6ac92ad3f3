"""The application of a Serve config file: ``import_path: cluster.serve_config:app_builder``.

``serve run FILE``, ``serve deploy FILE`` and ``tpserve serve --config FILE`` build the same
application as ``tpserve serve`` from the ``args`` of the file's application. The keys of ``args``
are the ``tpserve serve`` options spelled with underscores (``model``, ``tp``, ``groups``,
``kv_target_occupancy``, ``host_kv_gb``, ``disk_kv_dir``, ...), each a value of the option's
type; an unknown key or a value of the wrong type is an error naming the key. Three options are
not args: where Serve listens is the file's ``http_options``, and the API key is never written in
the file: ``api_key_file`` names a file that holds it, or ``api_key_env`` the environment variable
that does, read where the application is built (on the Ray head for ``serve deploy``); see
``cluster.api.api_key`` for rotation.

``groups`` is a string, ``"N"`` or ``"MIN:MAX"``, quoted: YAML 1.1 reads an unquoted ``1:4`` as
the base-60 number 64.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from cluster.api.api_key import resolve_api_key
from cluster.app_config import ServeConfig, ServePlan
from cluster.options import (ENGINE_OPTIONS, PLAN_OPTIONS, SERVE_OPTIONS, Option, engine_config,
                             field_values, serve_config_from)
from workers.config import EngineConfig

IMPORT_PATH = "cluster.serve_config:app_builder"
API_KEY_ENV = "api_key_env"
_OPTION = re.compile(r"--([a-z][a-z-]*)")
# `tpserve serve` options that are not args, and where their value comes from instead.
NOT_ARGS = {
    "host": "the file's http_options.host",
    "port": "the file's http_options.port",
    "api_key": f"a file named by api_key_file, or an environment variable named by {API_KEY_ENV} "
               f"(never the key itself)",
}


def app_builder(args: Dict[str, Any]):
    """Serve's application builder: the file's ``args`` -> the tpserve application.

    Runs where Serve builds applications (the controller's build task, on the head node), so the
    cluster's resources and ``api_key_env`` are those of the cluster."""
    import ray

    from cluster.app import build_app, check_serve_config

    config = serve_config_from_args(args, os.environ)
    check_serve_config(config)
    return build_app(config, ray.cluster_resources())


def serve_config_from_args(args: Mapping[str, Any],
                           environ: Mapping[str, str]) -> ServeConfig:
    """The ``ServeConfig`` of a config file's ``args``; ``ValueError`` naming the bad key."""
    if not isinstance(args, Mapping):
        raise ValueError(f"args: expected a mapping of tpserve serve options, got "
                         f"{type(args).__name__}")
    options = arg_options()
    for key in args:
        if key in NOT_ARGS:
            raise ValueError(f"args.{key}: not an application arg; it comes from {NOT_ARGS[key]}")
        if key != API_KEY_ENV and key not in options:
            raise ValueError(f"args.{key}: unknown key; expected one of "
                             f"{', '.join(sorted([*options, API_KEY_ENV]))}")
    values = argparse.Namespace(**{key: opt.parsed_default() for key, opt in options.items()})
    for key, value in args.items():
        if key != API_KEY_ENV:
            setattr(values, key, _checked_value(key, options[key], value))
    if API_KEY_ENV in args and args.get("api_key_file") is not None:
        raise ValueError(f"args.{API_KEY_ENV} and args.api_key_file: give one of them, not both")
    api_key = _api_key(args.get(API_KEY_ENV), environ)
    try:
        config = serve_config_from(values, engine_config(values), api_key)
        resolve_api_key(config.api_key, config.api_key_file)  # the file is read where built
        return config
    except ValueError as exc:  # the engine's checks name the option (--tp): name the key (args.tp)
        raise ValueError(_OPTION.sub(lambda m: "args." + m[1].replace("-", "_"), str(exc))) \
            from None


def arg_options() -> Dict[str, Option]:
    """The keys an application's ``args`` may hold, with the option each one stands for."""
    return {opt.dest: opt for opt in (*ENGINE_OPTIONS, *SERVE_OPTIONS) if opt.dest not in NOT_ARGS}


def _checked_value(key: str, option: Option, value: Any) -> Any:
    """``value`` if it has the type (and is one of the choices) of ``option``."""
    if value is None and option.default is None:
        return None
    if option.kind is bool:
        expected, ok = "true or false", isinstance(value, bool)
    elif option.kind is int:
        expected, ok = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif option.kind is float:
        expected = "a number"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        expected, ok = "a string", isinstance(value, str)
        if key == "groups" and not ok:
            expected = 'a quoted string "N" or "MIN:MAX" (YAML reads an unquoted 1:4 as 64)'
    if ok and option.choices is not None and value not in option.choices:
        expected, ok = f"one of {', '.join(map(str, option.choices))}", False
    if not ok:
        raise ValueError(f"args.{key}: expected {expected}, got {value!r}")
    return value


def _api_key(env_name: Any, environ: Mapping[str, str]) -> Optional[str]:
    if env_name is None:
        return None
    if not isinstance(env_name, str) or not env_name.isidentifier():
        raise ValueError(f"args.{API_KEY_ENV}: expected the name of an environment variable, got "
                         f"{env_name!r}")
    key = environ.get(env_name, "")
    if not key:
        raise ValueError(f"args.{API_KEY_ENV}: the environment variable {env_name} is not set "
                         f"(or empty) where the application is built; set it, or drop "
                         f"{API_KEY_ENV} to serve without an API key")
    return key


# ----- tpserve serve -----


def plan_from_cli(args: argparse.Namespace, engine: EngineConfig) -> ServePlan:
    return ServePlan(serve_config_from(args, engine, args.api_key),
                     **field_values(PLAN_OPTIONS, args))


def plan_from_file(path: Path, changed_options: Sequence[str] = ()) -> ServePlan:
    """``tpserve serve --config FILE``: the file's tpserve application and its http_options.

    Refuses what it would otherwise ignore: options given beside the file, a file without
    exactly one tpserve application, and per-deployment overrides or a ``runtime_env`` (those
    need Serve's own ``serve run``)."""
    if changed_options:
        names = ", ".join("--" + name.replace("_", "-") for name in changed_options)
        raise ValueError(f"{names}: not allowed with --config; set them in {path}'s args "
                         f"(or http_options)")
    schema = read_config_file(path)
    apps = [app for app in schema.applications if app.import_path == IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"{path}: expected one application with import_path {IMPORT_PATH}, "
                         f"found {len(apps)}")
    app = apps[0]
    if app.deployments or app.runtime_env:
        raise ValueError(f"{path}: application {app.name!r} sets deployments or runtime_env, "
                         f"which tpserve serve --config does not apply; use serve run {path}")
    try:
        config = serve_config_from_args(app.args, os.environ)
    except ValueError as exc:
        raise ValueError(f"{path}, application {app.name!r}: {exc}") from None
    return ServePlan(config, host=schema.http_options.host, port=schema.http_options.port,
                     app_name=app.name, route_prefix=app.route_prefix or "/",
                     grpc_options=schema.grpc_options.model_dump())


def read_config_file(path: Path):
    """The file as Serve reads it (``ServeDeploySchema``); ``ValueError`` naming the file."""
    import pydantic
    import yaml
    from ray.serve.schema import ServeDeploySchema

    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    try:
        return ServeDeploySchema.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ValueError(f"{path}: not a Serve config file: {exc}") from None
