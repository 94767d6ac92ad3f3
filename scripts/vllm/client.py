"""The project's handle on ``runner.py`` running in the vLLM virtualenv: one process per dtype,
the model loaded once, then one workload a call (the protocol is in ``runner.py``'s docstring).

The runner's stderr (vLLM's logs) goes to a log file; a runner that fails raises ``VllmError``
naming that file and its last error line."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Dict, Optional

from scripts.vllm.runner import write_workload
from scripts.vllm.venv import last_error_line

RUNNER = Path(__file__).resolve().parent / "runner.py"


class VllmError(RuntimeError):
    """The vLLM runner failed; the message names its log file."""


class VllmRunner:
    """``runner.py`` under ``python`` for one model and dtype; ``run`` times one workload."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, max_model_len: int,
                 kv_space_gib: int, log_path: Path, reserved_cpus: Optional[int] = None):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no tpserve imports
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
        if reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._proc = subprocess.Popen(
            [str(python), str(RUNNER), "--model", str(model_dir), "--dtype", dtype,
             "--max-model-len", str(max_model_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
            cwd=str(log_path.parent))
        try:
            self.info = self._read("loading the model")
        except BaseException:
            self.close()
            raise
        self.info["worker_cores"] = worker_cores(log_path.read_text(errors="replace"))

    def run(self, workload_path: Path) -> Dict[str, object]:
        """``{"workload", "wall_s", "num_output_tokens", "outputs"}`` of one workload file."""
        self._proc.stdin.write(f"{workload_path}\n")
        self._proc.stdin.flush()
        return self._read(f"generating {workload_path.name}")

    def _read(self, what: str) -> Dict[str, object]:
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._log.flush()
            reason = last_error_line(self.log_path.read_text(errors="replace").splitlines())
            raise VllmError(f"vLLM runner exited (code {self._proc.returncode}) while {what}: "
                            f"{reason} (full log: {self.log_path})")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> "VllmRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def worker_cores(log: str) -> Optional[str]:
    """The CPU ids vLLM bound its worker's OpenMP threads to, from its log (None: not logged)."""
    found = re.findall(r"core ids=(\[[\d, ]*\])", log)
    return found[-1] if found else None


def write_workload_file(directory: Path, workload) -> Path:
    """``workload`` (a ``scripts.engine.workloads.Workload``) as the runner's input file."""
    path = directory / f"{workload.name}.json"
    write_workload(path, workload.name, workload.prompts, workload.max_tokens)
    return path


