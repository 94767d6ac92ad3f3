"""scripts/check_cuda_tiers.py, the GPU check, run on CPU: every check passes and it says so."""

import json

import pytest

from bench_scripts import run_script


@pytest.mark.slow
def test_cpu_smoke_run_passes_every_check():
    result = run_script("check_cuda_tiers", "--device", "cpu", "--blocks", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    for check in ("spill_ok", "restore_equal", "corruption_caught", "engine_equal"):
        assert report[check] is True
    assert report["engine_restored_bytes"] > 0


def test_without_cuda_it_asks_for_the_cpu_run():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA run is the real one")
    result = run_script("check_cuda_tiers")
    assert result.returncode == 2 and "--device cpu" in result.stderr
