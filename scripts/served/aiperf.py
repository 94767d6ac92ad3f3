"""NVIDIA ``aiperf`` as the served comparison's load generator, in a virtualenv of its own (it pins
its dependencies), beside the project's: created once, reused while its marker file names the
same version (``scripts/vllm/venv.py``'s scheme; failures raise its ``VenvError``, one line).

A run: ``aiperf profile`` against one server's chat endpoint, streaming, synthetic prompts of a
fixed token count (the checkpoint's tokenizer), a fixed output length with ``ignore_eos`` and
temperature 0, a fixed concurrency and request count, a seed, a short warm-up, and the server's
own token counts (``--use-server-token-count``: the usage chunk, not a re-tokenized text). The
figures come from the JSON export aiperf writes into the run's artifact directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from scripts.vllm.venv import _step, install, last_error_line, marked_ready

AIPERF_PACKAGE = "aiperf"
AIPERF_VERSION = "0.13.0"
MARKER = "tpserve-aiperf-ready"
EXPORT = "profile_export_aiperf.json"


def is_ready(venv: Path, version: str = AIPERF_VERSION) -> bool:
    return marked_ready(venv, MARKER, f"{AIPERF_PACKAGE}=={version}")


def ensure_aiperf(venv: Path, version: str = AIPERF_VERSION, log=print) -> Path:
    """The ``aiperf`` executable of a working virtualenv at ``venv``, created or finished
    first."""
    venv = venv.absolute()
    executable = venv / "bin" / "aiperf"
    if is_ready(venv, version):
        return executable
    spec = f"{AIPERF_PACKAGE}=={version}"
    log(f"setting up the aiperf virtualenv {venv} ({spec}; once, a minute or two)")
    install(venv, spec, "aiperf",
            "fix that and rerun (or pass --aiperf-venv another writable directory)")
    _step([str(executable), "--version"], f"aiperf in {venv} does not run",
          f"remove {venv} and rerun to reinstall")
    (venv / MARKER).write_text(spec + "\n")
    return executable


@dataclass(frozen=True)
class AiperfLoad:
    """One load: what every server is driven with."""

    model: str
    tokenizer: Path
    input_tokens: int
    output_tokens: int
    concurrency: int
    num_requests: int
    seed: int = 0
    num_warmup: int = 2

    def command(self, executable: Path, server_url: str, artifacts: Path) -> List[str]:
        return [str(executable), "profile", "--model", self.model, "--url", server_url,
                "--endpoint-type", "chat", "--streaming", "--tokenizer", str(self.tokenizer),
                "--prompt-input-tokens-mean", str(self.input_tokens),
                "--prompt-input-tokens-stddev", "0",
                "--prompt-output-tokens-mean", str(self.output_tokens),
                "--prompt-output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
                "--use-server-token-count", "--concurrency", str(self.concurrency),
                "--request-count", str(self.num_requests),
                "--warmup-request-count", str(self.num_warmup),
                "--random-seed", str(self.seed), "--ui-type", "none",
                "--workers-max", "1", "--artifact-dir", str(artifacts)]


class AiperfError(RuntimeError):
    """aiperf failed or wrote no figures (one line, naming its log)."""


def run_aiperf(executable: Path, load: AiperfLoad, server_url: str, artifacts: Path,
               timeout_s: float = 1800.0) -> Dict[str, Optional[float]]:
    """Drive the server at ``server_url`` (``http://host:port``) with ``load``; its figures."""
    artifacts.mkdir(parents=True, exist_ok=True)
    log = artifacts / "aiperf-console.log"
    with open(log, "w") as out:
        try:
            proc = subprocess.run(load.command(executable, server_url, artifacts), stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout_s, env=_env())
        except subprocess.TimeoutExpired:
            raise AiperfError(f"aiperf ran past {timeout_s:.0f} s (log: {log})") from None
    if proc.returncode != 0 or not (artifacts / EXPORT).is_file():
        reason = last_error_line(log.read_text(errors="replace").splitlines())
        raise AiperfError(f"aiperf failed (exit {proc.returncode}): {reason} (log: {log})")
    return export_figures(json.loads((artifacts / EXPORT).read_text()))


def _env() -> Dict[str, str]:
    """aiperf's environment: without ``HF_HUB_OFFLINE``, under which its tokenizer loader takes
    a local checkpoint directory for a Hub repository id and fails."""
    return {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}


def export_figures(export: Dict) -> Dict[str, Optional[float]]:
    """The comparison's figures from aiperf's JSON export (its times are in ms; these in s)."""
    def stat(name: str, key: str, scale: float = 1.0) -> Optional[float]:
        value = (export.get(name) or {}).get(key)
        return None if value is None else value * scale

    return {"output_tok_s": stat("output_token_throughput", "avg"),
            "ttft_p50_s": stat("time_to_first_token", "p50", 1e-3),
            "ttft_p99_s": stat("time_to_first_token", "p99", 1e-3),
            "itl_p50_s": stat("inter_token_latency", "p50", 1e-3),
            "num_requests": stat("request_count", "avg"),
            "num_failed": stat("error_request_count", "avg") or 0.0,
            "mean_output_tokens": stat("output_sequence_length", "avg"),
            "wall_s": stat("benchmark_duration", "avg")}
