"""scripts/gpu_check.py, the prepared GPU check: its CPU run passes every check it runs and says
so in one JSON line; its runner, variant detection and trace copy on plain inputs."""

import argparse
import dataclasses
import json
import sys
import time
import types
from pathlib import Path
from typing import Optional

import pytest
import torch

from bench_scripts import load_script, run_script

SECTIONS = {"greedy_parity", "sampling", "triton_attention", "tier_copies", "throughput",
            "decode_steady", "memory_sizing", "fused_kernels"}


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")  # also puts scripts/ on sys.path for its modules


@pytest.mark.slow
def test_cpu_quick_run_passes_every_check_it_runs(tmp_path):
    started = time.perf_counter()
    result = run_script("gpu_check", "--device", "cpu", "--quick",
                        "--json-out", str(tmp_path / "out.json"))
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == report
    assert report["passed"] is True and report["failed"] == [] and report["complete"] is True
    assert report["device_type"] == "cpu" and report["skipped"] == []
    assert set(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] in ("passed", "not available"), (name, section)
        assert all(section["checks"].values()), (name, section["checks"])
    assert any(k.startswith("fp32 torch") for k in report["sections"]["greedy_parity"]["checks"])
    assert len(report["sections"]["sampling"]["checks"]) >= 6
    throughput = report["sections"]["throughput"]["figures"]
    for key in ("tokens_per_s", "ratio_vs_hf_generate", "roofline_frac",
                "hf_generate_tokens_per_s"):
        assert throughput[key] > 0
    assert report["sections"]["tier_copies"]["figures"]["checksum_gbps"] > 0
    steady = report["sections"]["decode_steady"]
    assert len(steady["checks"]) == 3 and all(steady["checks"].values()), steady
    assert steady["figures"]["b4.overlap_speedup"] > 0
    for loop in ("serial", "overlapped"):
        assert steady["figures"][f"b4.{loop}.ms_per_step"] > 0
    assert report["sections"]["memory_sizing"]["checks"] == {"refused on CPU by name": True}
    fused = report["sections"]["fused_kernels"]
    assert fused["status"] == "passed" and len(fused["checks"]) == 7, fused
    assert fused["figures"]["kernels_per_layer_dispatched_float32"] <= 12 < \
        fused["figures"]["kernels_per_layer_dispatched_unfused_float32"]
    print(f"gpu_check --device cpu --quick: {elapsed:.0f} s")


def test_without_cuda_it_asks_for_the_cpu_run():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA run is the real one")
    result = run_script("gpu_check")
    assert result.returncode == 2 and "--device cpu --quick" in result.stderr


def test_cpu_without_quick_is_refused(gpu_check):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--device", "cpu"])
    assert exc.value.code == 2


# ----- the runner: one failing section does not hide the others -----


def _fake_sections(monkeypatch, gpu_check):
    def ok(ctx, report):
        report.check("fine", True)
        report.figure("rate", 1.5)

    def fails(ctx, report):
        report.check("wrong answer", False)

    def raises(ctx, report):
        raise RuntimeError("kernel exploded")

    def missing(ctx, report):
        report.unavailable("kernel", "module does not exist")

    module = types.ModuleType("fake_sections")
    module.ok, module.fails, module.raises, module.missing = ok, fails, raises, missing
    monkeypatch.setitem(sys.modules, "fake_sections", module)
    sections = tuple((name, "fake_sections", name, name) for name in
                     ("ok", "raises", "fails", "missing", "ok"))
    monkeypatch.setattr(gpu_check, "SECTIONS", sections)


def test_a_failing_section_does_not_hide_the_others(monkeypatch, gpu_check, capsys):
    _fake_sections(monkeypatch, gpu_check)
    args = argparse.Namespace(sections=["ok", "raises", "fails", "missing"], time_budget_s=60.0,
                              json_out=None)
    reports = []
    gpu_check.run_sections(None, args, time.perf_counter(), {"script": "gpu_check"}, reports)
    result = gpu_check.summary({"script": "gpu_check"}, reports, time.perf_counter())
    assert [r.name for r in reports] == ["ok", "raises", "fails", "missing", "ok"]
    assert result["passed"] is False and result["failed"] == ["raises", "fails"]
    assert result["not_available"] == ["missing"]
    assert result["sections"]["raises"]["error"] == "RuntimeError: kernel exploded"
    assert result["sections"]["ok"]["figures"] == {"rate": 1.5}
    json.dumps(result)
    assert "kernel exploded" in capsys.readouterr().out


def test_a_fault_left_for_the_teardown_is_the_sections_error_and_the_run_goes_on(
        monkeypatch, gpu_check):
    # A sticky CUDA fault makes empty_cache raise in the teardown of the section that caused it
    # (free_device_memory returns that error instead of raising: simulated, no GPU here).
    from scripts.gpu import common as gpu_check_common

    _fake_sections(monkeypatch, gpu_check)
    faults = iter(["RuntimeError: CUDA error: an illegal memory access was encountered"])
    monkeypatch.setattr(gpu_check_common, "free_device_memory", lambda: next(faults, None))
    args = argparse.Namespace(sections=["ok", "fails"], time_budget_s=60.0, json_out=None)
    reports = []
    gpu_check.run_sections(None, args, time.perf_counter(), {}, reports)
    assert [r.name for r in reports] == ["ok", "fails", "ok"]
    assert "illegal memory access" in reports[0].error and reports[2].error is None


def test_the_summary_is_printed_even_when_the_runner_fails(monkeypatch, gpu_check, capsys):
    from scripts.gpu.common import Report

    def broken(ctx, args, started, header, reports):
        reports.append(Report("greedy_parity"))
        raise OSError("no space left on device")

    monkeypatch.setattr(gpu_check, "run_sections", broken)
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 1
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["passed"] is False and "no space left" in result["runner_error"]
    assert list(result["sections"]) == ["greedy_parity"]


def test_sections_past_the_time_budget_are_skipped_not_failed(monkeypatch, gpu_check):
    _fake_sections(monkeypatch, gpu_check)
    args = argparse.Namespace(sections=["ok"], time_budget_s=10.0, json_out=None)
    reports = []
    gpu_check.run_sections(None, args, time.perf_counter() - 11, {}, reports)
    result = gpu_check.summary({}, reports, time.perf_counter())
    assert result["skipped"] == ["ok", "ok"] and result["passed"] is True


def test_mismatch_counts_positions_and_missing_tokens(gpu_check):
    from scripts.gpu.common import token_mismatch

    drift = token_mismatch([[1, 2, 3], [4, 5], [7, 8]], [[1, 2, 3], [4, 6, 6], [9, 8]])
    assert drift["token_mismatch_rate"] == pytest.approx(3 / 8)
    assert drift["seqs_equal_frac"] == pytest.approx(1 / 3)
    assert drift["first_token_mismatch_rate"] == pytest.approx(1 / 3)


# ----- what EngineConfig offers decides the variants run -----


@dataclasses.dataclass(frozen=True)
class PlainConfig:
    model: str


@dataclasses.dataclass(frozen=True)
class FullConfig:
    model: str
    attention_backend: str = "auto"
    enforce_eager: bool = False


@dataclasses.dataclass(frozen=True)
class OtherDefaultConfig:
    model: str
    attention_backend: Optional[str] = "flash"


def test_variants_follow_the_config_fields(gpu_check):
    from scripts.gpu import parity

    assert parity.variants(PlainConfig) == [parity.Variant()]
    assert parity.Variant().kwargs() == {} and parity.Variant().name == "default"
    full = parity.variants(FullConfig)
    assert [v.name for v in full] == ["torch/cuda-graphs", "torch/eager",
                                      "triton/cuda-graphs", "triton/eager"]
    assert full[1].kwargs() == {"attention_backend": "torch", "enforce_eager": True}
    assert parity.attention_backends(OtherDefaultConfig) == ["torch", "triton", "flash"]
    assert parity.graph_modes(OtherDefaultConfig) == [None]


TRACE_HEAD = Path(__file__).parent.parent / "data/traces/AzureLLMInferenceTrace_code_first64.csv"


def test_trace_lengths_are_the_first_64_azure_code_requests(gpu_check):
    from scripts.gpu import throughput
    from scripts.traces import read_azure

    rows = read_azure(TRACE_HEAD, 64)
    assert len(rows) == 64
    assert throughput.TRACE_LENGTHS == tuple((r.num_prompt_tokens, r.num_output_tokens)
                                             for r in rows)


# ----- the device checksum checks' own logic, with the kernel's numpy twin on CPU -----


def test_device_checksum_tier_path_passes_with_the_reference_hasher(gpu_check, monkeypatch,
                                                                    tmp_path):
    from scripts.gpu import device_checksum
    from scripts.gpu.common import Report
    from kv.tiers import block_copier
    from kv.integrity.block_checksum import ReferenceBlockHasher, mix64_strategy

    monkeypatch.setattr(block_copier, "choose_block_checksum",
                        lambda kv_cache: mix64_strategy(ReferenceBlockHasher(kv_cache)))
    report = Report("tier_copies")
    device_checksum.check_tier_path(torch.device("cpu"), tmp_path, report)
    assert len(report.checks) == 4 and all(report.checks.values()), report.checks


def test_device_checksum_is_not_available_on_cpu_or_without_cupy(gpu_check, monkeypatch):
    from scripts.gpu import device_checksum
    from scripts.gpu.common import Report

    ctx = types.SimpleNamespace(is_cuda=False)
    report = Report("tier_copies")
    device_checksum.check_device_checksum(ctx, report, 8)
    assert report.status == "not available" and "CUDA device" in report.not_available[
        "device_checksum"]
    monkeypatch.setitem(sys.modules, "cupy", None)
    report = Report("tier_copies")
    device_checksum.check_device_checksum(types.SimpleNamespace(is_cuda=True), report, 8)
    assert report.status == "not available" and report.checks == {}
    assert report.not_available["device_checksum"].startswith("cupy not installed")
