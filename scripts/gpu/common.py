"""What every section of ``scripts/gpu_check.py`` shares: the run's context (device, sizes, a
scratch directory, the parity checkpoint built once) and the report a section fills in.

A section is a function ``check(ctx, report)``. It records named pass/fail checks, figures, and
what it could not run (``not available``, with the reason); the runner turns an exception into a
section error, so one broken check never hides the others.
"""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

PASSED, FAILED, ERROR, NOT_AVAILABLE, SKIPPED = (
    "passed", "failed", "error", "not available", "skipped")


@dataclass
class Report:
    """One section's findings, printed as they come (a run cut short still shows its progress)."""

    name: str
    checks: Dict[str, bool] = field(default_factory=dict)
    figures: Dict[str, object] = field(default_factory=dict)
    not_available: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None
    skipped: Optional[str] = None
    seconds: float = 0.0

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks[name] = bool(ok)
        print(f"  {'ok' if ok else 'FAILED':<8}{name}{': ' + detail if detail else ''}",
              flush=True)
        return bool(ok)

    def figure(self, name: str, value, unit: str = "") -> None:
        self.figures[name] = _plain(value)
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"  {'':<8}{name} = {shown}{' ' + unit if unit else ''}", flush=True)

    def unavailable(self, name: str, reason: str) -> None:
        self.not_available[name] = reason
        print(f"  {'n/a':<8}{name}: {reason}", flush=True)

    @property
    def status(self) -> str:
        if self.skipped is not None:
            return SKIPPED
        if self.error is not None:
            return ERROR
        if not all(self.checks.values()):
            return FAILED
        return PASSED if self.checks or not self.not_available else NOT_AVAILABLE

    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {"status": self.status, "seconds": round(self.seconds, 2),
                                  "checks": self.checks, "figures": self.figures,
                                  "not_available": self.not_available}
        if self.error is not None:
            out["error"] = self.error
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


def _plain(value):
    """A JSON-safe copy: NaN and infinities become None (JSON has no spelling for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class CheckContext:
    """The run's settings and what sections share. ``quick``: tiny sizes (the CPU test run)."""

    device: torch.device
    quick: bool
    workdir: Path
    args: argparse.Namespace
    _parity_model: Optional[Path] = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def parity_model(self) -> Path:
        """A random Llama checkpoint for the parity and sampling checks, built once: tiny with
        ``--quick``, else small (head_dim 64, GQA 4:1, 4 layers) so it still takes seconds."""
        if self._parity_model is None:
            from scripts.gpu.models import SMALL, TINY, build_checkpoint

            shape = TINY if self.quick else SMALL
            build_checkpoint(self.workdir / "parity", shape)
            self._parity_model = self.workdir / "parity"
        return self._parity_model


def free_device_memory() -> Optional[str]:
    """Let the next engine or model have the memory of the last one. Returns the error instead
    of raising it: after a fault (an illegal address is sticky) every CUDA call fails, and the
    caller still has to report the sections and print the summary."""
    gc.collect()
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def synchronize() -> None:
    """Wait for the GPU's queued work (where CUDA is in use), so that an asynchronous fault is
    raised in the section that caused it and not in the next one."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def token_mismatch(got: Sequence[List[int]], want: Sequence[List[int]]) -> Dict[str, float]:
    """How far two sets of generations differ, position by position (a missing position counts
    as a mismatch): the token mismatch rate, the share of sequences equal, and the share whose
    first token (the prefill's argmax, before any divergence compounds) differs."""
    total = mismatched = 0
    for a, b in zip(got, want):
        width = max(len(a), len(b))
        total += width
        mismatched += sum(i >= len(a) or i >= len(b) or a[i] != b[i] for i in range(width))
    num = max(1, len(want))
    return {"token_mismatch_rate": mismatched / max(1, total),
            "seqs_equal_frac": sum(a == b for a, b in zip(got, want)) / num,
            "first_token_mismatch_rate": sum(a[:1] != b[:1] for a, b in zip(got, want)) / num}
