"""A configuration field that is also a command-line option: ``option(default, help, ...)``
declares the field's default and the option's spelling and help in one place.

The dataclasses (``workers.config.EngineConfig``, ``cluster.app_config.ServeConfig``) are the one
definition; ``cluster.options`` generates the CLI and the Serve config file's args from them.
This module knows nothing of argparse or of ``cluster/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

METADATA_KEY = "tpserve.option"


@dataclass(frozen=True)
class OptionSpec:
    """How a field is spelled on the command line (its default is the field's own)."""

    help: str
    flag: Optional[str] = None  # None: ``--`` and the field's name with dashes
    choices: Optional[Tuple[str, ...]] = None
    group: Optional[str] = None  # the title of the help section it is listed under
    env: Optional[str] = None  # an environment variable that replaces the default on the CLI

    def __post_init__(self) -> None:
        if self.flag is not None and not self.flag.startswith("--"):
            raise ValueError(f"option flag {self.flag!r}: expected a long option, --name")


def option(default: Any, help: str, *, flag: Optional[str] = None,
           choices: Optional[Tuple[str, ...]] = None, group: Optional[str] = None,
           env: Optional[str] = None) -> Any:
    """A dataclass field with ``default`` that ``cluster.options`` offers as ``flag``.

    A bool field becomes a switch: ``--name`` turns on a field that defaults to False, and the
    flag given for a field that defaults to True (``--no-...``) turns it off."""
    spec = OptionSpec(help=help, flag=flag, choices=tuple(choices) if choices else None,
                      group=group, env=env)
    return dataclasses.field(default=default, metadata={METADATA_KEY: spec})


def option_spec(field: dataclasses.Field) -> Optional[OptionSpec]:
    """The field's ``OptionSpec``; None for a field that is not an option."""
    return field.metadata.get(METADATA_KEY)
