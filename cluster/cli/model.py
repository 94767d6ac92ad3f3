"""`tpserve model default`: materialize the default model and print its directory."""

from __future__ import annotations

import argparse

from workers.default_model import materialize_default_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="manage model checkpoints")
    actions = parser.add_subparsers(dest="action", required=True)
    default = actions.add_parser("default", help="materialize SmolLM2-135M-Instruct and print its path")
    default.add_argument("--cache-dir", default=None, help="where checkpoints are kept "
                         "(default: $TPSERVE_CACHE or ~/.cache/tpserve)")
    default.set_defaults(func=_default)


def _default(args: argparse.Namespace) -> int:
    print(materialize_default_model(args.cache_dir))
    return 0
