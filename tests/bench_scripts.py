"""Running the benchmark scripts under ``scripts/`` from tests: as a module (their pure parts) and
as a subprocess, the way a user runs them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def script_path(name: str) -> Path:
    return REPO / "scripts" / f"{name}.py"


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python scripts/<name>.py args...`` from the repository root, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(script_path(name)), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
