"""The check's phase clock and its command runner: every phase's wall time, in order, and every
command's output in a log file (its tail in the error when it fails)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence


class CheckFailed(RuntimeError):
    """A phase failed: the message says which and why."""


class Interrupted(BaseException):
    """SIGTERM, SIGHUP or SIGINT arrived: unwinds through the cleanup like KeyboardInterrupt."""


def raise_on_signals() -> None:
    """The first of these signals raises `Interrupted`; later ones are ignored, so that the
    cleanup it unwinds into runs to its end."""
    def handler(signum, _frame):
        for other in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(other, lambda *_: print("cleaning up; wait", flush=True))
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, handler)


class Clock:
    """Phase name -> seconds, printed as each phase ends."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: Dict[str, float] = {}
        self.failed: Optional[str] = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        print(f"[{name}] ...", flush=True)
        began = time.monotonic()
        try:
            yield
        except BaseException:
            self.failed = self.failed or name
            raise
        finally:
            self.seconds[name] = round(time.monotonic() - began, 1)
            print(f"[{name}] {self.seconds[name]:.1f} s", flush=True)

    def total(self) -> float:
        return round(time.monotonic() - self.started, 1)


class Runner:
    """Runs commands with a base environment, each one's output appended to `logs/<name>.log`."""

    def __init__(self, logs: Path, env: Mapping[str, str], cwd: Path) -> None:
        self.logs, self.env, self.cwd = logs, dict(env), cwd
        logs.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, argv: Sequence[str], timeout_s: float,
            env: Optional[Mapping[str, str]] = None) -> str:
        """`argv`'s output; `CheckFailed` with the log's tail when it fails or times out."""
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                       cwd=self.cwd, env={**self.env, **(env or {})},
                                       start_new_session=True)
            try:
                code = process.wait(timeout=timeout_s)
            except BaseException:  # a timeout or a signal: nothing it started stays behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                if sys.exc_info()[0] is not subprocess.TimeoutExpired:
                    raise
                code = None
        text = log.read_text(errors="replace")
        if code != 0:
            why = f"timed out after {timeout_s:.0f} s" if code is None else f"exited {code}"
            raise CheckFailed(f"{name}: `{' '.join(argv[:3])} ...` {why}; last lines of "
                              f"{log}:\n{tail(text)}")
        return text


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def report(clock: Clock, passed: bool, details: Mapping, problems: List[str]) -> str:
    """The JSON line the check prints last."""
    return json.dumps({"passed": passed, "failed_phase": clock.failed, "phases_s": clock.seconds,
                       "total_s": clock.total(), **details, "cleanup_problems": problems})
