"""The options of every command that runs a model, and of `serve`, generated from the one typed
definition: the ``option`` fields of ``EngineConfig``, ``ServePlan`` and ``ServeConfig``
(``workers.option_field``). The CLI (`cluster.cli`), a Serve config file's ``args``
(`cluster.serve_config`) and the configuration page (docs/configuration.md) are built from them.

A field's option is ``--`` and its name with dashes unless its metadata spells it otherwise
(``tp_size``: ``--tp``); its argparse dest is the flag with underscores (``tp``), which is also its
key in a config file's args. The type is the field's annotation: int, float or str (``Optional``
ones default to None); a bool field is a switch (``--enforce-eager`` turns on a False field,
``--no-prefix-cache`` turns off a True one; an ``Optional[bool]`` field that defaults to None,
for "decided at run time", has both ``--name`` and ``--no-name``). Defaults are the fields' own.

What is not one field per option, all handled here:
  ``--groups N|MIN:MAX``  ``ServeConfig.min_groups``/``max_groups`` (``parse_groups``); its
                          default is those fields' defaults (``format_groups``)
  ``--seed``              not an engine option: `generate`'s sampling seed, which also seeds the
                          engine; absent or None: ``EngineConfig.seed``'s default
  ``--api-key``           ``ServeConfig.api_key``, its CLI default ``$TPSERVE_API_KEY`` (the
                          field's ``env``); passed in explicitly, since a config file names an
                          environment variable instead (``api_key_env``)
  ``--host``, ``--port``  ``ServePlan`` fields (where Serve listens), not ``ServeConfig``'s; a
                          config file has them in ``http_options``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

from cluster.app_config import ServeConfig, ServePlan, format_groups, parse_groups
from workers.config import EngineConfig
from workers.option_field import option_spec

_TYPES = (int, float, str, bool)


@dataclass(frozen=True)
class Option:
    """One command-line option: the field it sets and how it is spelled, typed and defaulted."""

    flag: str
    kind: type  # int, float, str, or bool (a switch)
    default: Any  # the field's default
    help: str
    field: Optional[str] = None  # None: converted explicitly (``--groups``)
    choices: Optional[Tuple[str, ...]] = None
    group: Optional[str] = None
    env: Optional[str] = None

    @property
    def dest(self) -> str:
        """The argparse dest, and the key in a config file's args."""
        return self.flag[2:].replace("-", "_")

    @property
    def is_tristate(self) -> bool:
        """A bool field that defaults to None (auto): ``--name`` and ``--no-name`` both exist."""
        return self.kind is bool and self.default is None

    def parsed_default(self) -> Any:
        """What the parser holds when the option is not given."""
        if self.is_tristate:
            return None
        if self.kind is bool:
            return False
        return os.environ.get(self.env, self.default) if self.env else self.default

    def field_value(self, parsed: Any) -> Any:
        """The field's value for the parsed value: a given switch flips its field's default (a
        tri-state one is what was given, or None)."""
        if self.kind is bool and not self.is_tristate:
            return not self.default if parsed else self.default
        return parsed


def field_options(cls: type) -> Tuple[Option, ...]:
    """The options of ``cls``'s ``option`` fields, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        spec = option_spec(field)
        if spec is None:
            continue
        kind = _option_type(hints[field.name], f"{cls.__name__}.{field.name}")
        found.append(Option(flag=spec.flag or "--" + field.name.replace("_", "-"), kind=kind,
                            default=field.default, help=spec.help, field=field.name,
                            choices=spec.choices, group=spec.group, env=spec.env))
    return tuple(found)


def _option_type(hint: Any, name: str) -> type:
    """int, float, str or bool, also inside ``Optional[...]``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    if kind not in _TYPES:
        raise TypeError(f"{name}: an option field must be int, float, str or bool (or Optional "
                        f"of one), got {hint}")
    return kind


def _field_default(cls: type, name: str) -> Any:
    return next(field.default for field in dataclasses.fields(cls) if field.name == name)


ENGINE_OPTIONS = field_options(EngineConfig)
GROUPS = Option("--groups", str, format_groups(_field_default(ServeConfig, "min_groups"),
                                              _field_default(ServeConfig, "max_groups")),
                help="TP groups: N, or MIN:MAX to autoscale")
PLAN_OPTIONS = field_options(ServePlan)  # --host, --port
SERVE_CONFIG_OPTIONS = field_options(ServeConfig)
SERVE_OPTIONS = (GROUPS, *PLAN_OPTIONS, *SERVE_CONFIG_OPTIONS)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """``options`` as arguments of ``parser``, each under its group's heading if it has one."""
    groups: Dict[str, Any] = {}
    for opt in options:
        target = parser
        if opt.group is not None:
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            target = groups[opt.group]
        kwargs: Dict[str, Any] = {"default": opt.parsed_default(), "help": opt.help}
        if opt.is_tristate:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif opt.kind is bool:
            kwargs["action"] = "store_true"
        else:
            if opt.kind is not str:
                kwargs["type"] = opt.kind
            if opt.choices is not None:
                kwargs["choices"] = opt.choices
        target.add_argument(opt.flag, **kwargs)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that runs a model."""
    add_options(parser, ENGINE_OPTIONS)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `serve` beyond the engine's (also the keys of a Serve config file's args)."""
    add_options(parser, SERVE_OPTIONS)


def field_values(options: Iterable[Option], values: argparse.Namespace) -> Dict[str, Any]:
    """``{field: value}`` of the parsed ``values`` of the options that set one field each."""
    return {opt.field: opt.field_value(getattr(values, opt.dest))
            for opt in options if opt.field is not None}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    fields = field_values(ENGINE_OPTIONS, args)
    if getattr(args, "seed", None) is not None:  # generate's sampling seed seeds the engine too
        fields["seed"] = args.seed
    return EngineConfig(**fields)


def serve_config_from(values: argparse.Namespace, engine: EngineConfig,
                      api_key: Optional[str]) -> ServeConfig:
    """The ``ServeConfig`` of `tpserve serve`'s options, whether they came from the command line
    or from a config file's args; the API key comes from where each keeps it."""
    min_groups, max_groups = parse_groups(values.groups)
    fields = field_values([opt for opt in SERVE_CONFIG_OPTIONS if opt.field != "api_key"],
                          values)
    return ServeConfig(engine=engine, min_groups=min_groups, max_groups=max_groups,
                       api_key=api_key, **fields)
