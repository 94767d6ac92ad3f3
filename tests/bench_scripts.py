"""Running the benchmark scripts of the ``scripts`` package from tests: as a module (their pure
parts) and as a subprocess, the way a user runs them (``python -m scripts.<name>``)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def script_path(name: str) -> Path:
    """The file of ``scripts.<name>`` (a dotted name inside the package: ``tiers.replay``)."""
    return REPO / "scripts" / (name.replace(".", "/") + ".py")


def load_script(name: str) -> ModuleType:
    """Import ``scripts.<name>``."""
    return importlib.import_module(f"scripts.{name}")


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m scripts.<name> args...`` from the repository root, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", f"scripts.{name}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str,
                          returncode: Optional[int] = None) -> None:
    """``proc`` failed (with ``returncode``, when given) saying one line on stderr, ``error: ``
    and ``expected`` in it, and no traceback."""
    assert proc.returncode != 0 if returncode is None else proc.returncode == returncode, \
        proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def assert_flag_refused(script: ModuleType, capsys, argv, flag: str) -> None:
    """``script.parse_args(argv)`` exits with argparse's status 2, naming ``flag`` on stderr."""
    try:
        script.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError(f"{argv} was accepted")
    assert flag in capsys.readouterr().err
