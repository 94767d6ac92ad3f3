"""The `tpserve` command: one subcommand per module, each adding its own parser.

Bad input (a flag, a file, a checkpoint) raises `ValueError` or `OSError` with a message that names
it; this entry point prints that message and exits non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Optional, Sequence

from cluster.cli import generate as cli_generate
from cluster.cli import model as cli_model
from cluster.cli import serve as cli_serve
from cluster.cli import status as cli_status
from cluster.cli import topology as cli_topology

# Each module contributes `add_parser(subparsers)`; its parser sets `func(args) -> int`.
_SUBCOMMANDS = (cli_generate, cli_model, cli_serve, cli_status, cli_topology)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description="Tensor-parallel LLM serving.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in _SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, OSError) as exc:
        print(f"tpserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
