"""Argument handling both side-by-side benchmarks share (`scripts.bench_vs_vllm`,
`scripts.bench_served_vs_vllm`): ``--smoke`` presets, comma-separated choices, counts of at
least one. Each refusal is argparse's: exit status 2 and a message naming the flag."""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional, Sequence


def parse_with_smoke(p: argparse.ArgumentParser, argv: Optional[Sequence[str]],
                     smoke: Dict[str, object],
                     check: Callable[[argparse.ArgumentParser, argparse.Namespace], None]
                     ) -> argparse.Namespace:
    """``argv`` parsed, ``smoke``'s values set where ``--smoke`` was given, then ``check``ed."""
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in smoke.items():
            setattr(args, name, value)
    check(p, args)
    return args


def comma_choices(p: argparse.ArgumentParser, flag: str, text: str, allowed: Sequence[str],
                  noun: str) -> List[str]:
    """``text``'s comma-separated items, each one of ``allowed`` and at least one."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        p.error(f"{flag}: {', '.join(unknown) or 'empty'} is not a {noun}; expected a "
                f"comma-separated list of {', '.join(allowed)}")
    return items


def require_at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace,
                         names: Sequence[str]) -> None:
    """Each of ``args``' ``names`` at least 1 (the flag ``--name-with-dashes`` named if not)."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
