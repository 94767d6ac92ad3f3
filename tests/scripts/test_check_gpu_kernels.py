"""scripts/check_gpu_kernels.py: the Triton attention and fused decoder-layer kernels compile for a GPU (sm_90) on this
CPU machine, through Triton's CUDA compiler and ptxas, without spilling registers, and so does
the CuPy checksum kernel's CUDA C through NVRTC; the check fails when a tile size makes a kernel
spill, and on CUDA C that does not compile."""

from __future__ import annotations

import json

import pytest

from bench_scripts import load_script, run_script

pytest.importorskip("triton")


def run_check(*args: str):
    proc = run_script("check_gpu_kernels", *args, timeout=600)
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_launch_of_two_model_shapes_compiles_for_sm90_without_spills():
    proc, result = run_check("--quick")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert result["ok"] and result["num_failed"] == 0 and result["failures"] == []
    # 2 shapes x 2 dtypes x (decode: 1 kernel, split decode: 2, prefill: 1, short prefill: 1,
    # the layer's fused kernels: 4), and the checksum kernel (NVRTC is a dev dependency)
    assert result["num_compiled"] == 37 and result["arches"] == [90]
    assert result["nvrtc"] and result["num_cuda_c_compiled"] == 1
    assert result["spill_bytes"] == 0
    assert 0 < result["max_registers"] <= 255
    assert 0 < result["max_shared_bytes"] <= 232448
    for kernel in ("_decode_split_kernel", "_decode_combine_kernel", "_prefill_kernel",
                   "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_rope_write_kv_kernel",
                   "tpserve_kv_mix64"):
        assert kernel in proc.stdout


@pytest.mark.slow
def test_the_tile_that_spilled_in_fp32_fails_the_check():
    """The engine's fp32 prefill tile was 64 query rows until this check showed it spilling (up
    to 39.5 KB at head dim 128): asked for 64 rows again, the check fails and names it."""
    proc, result = run_check("--quick", "--dtypes", "fp32", "--prefill-block-m", "64")
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert not result["ok"] and result["spill_bytes"] > 0
    failed = {(f["shape"], f["step"]) for f in result["failures"]}
    assert ("Mistral-7B-v0.1", "prefill") in failed
    assert all(f["kernel"] == "_prefill_kernel" for f in result["failures"])
    assert all("spills" in f["problems"][0] for f in result["failures"])


@pytest.mark.parametrize("args, expected", [
    (("--arch", "75"), "no shared-memory limit known for [75]"),
    (("--arch", "sm90"), "expected comma-separated integers"),
    (("--dtypes", "fp8"), "unknown ['fp8']"),
    (("--prefill-block-m", "48"), "a power of two of at least 16"),
])
def test_bad_arguments_exit_2_naming_them(args, expected):
    proc = run_script("check_gpu_kernels", *args, timeout=120)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr


def test_cuda_c_that_does_not_compile_is_a_failure_with_nvrtcs_message():
    nvrtc_check = load_script("nvrtc_check")
    path = nvrtc_check.find_nvrtc()
    assert path, "NVRTC (nvidia-cuda-nvrtc-cu12) is a dev dependency"
    nvrtc = nvrtc_check.Nvrtc(path)
    row = nvrtc_check.compile_cuda_kernel(
        nvrtc, "broken", 'extern "C" __global__ void broken() { undefined_fn(); }', 90, 232448)
    assert row["problems"] and "undefined_fn" in row["problems"][0]
    name, source = nvrtc_check.CUDA_KERNELS[0]
    row = nvrtc_check.compile_cuda_kernel(nvrtc, name, source, 80, 166912)
    assert row["problems"] == [] and row["cubin_bytes"] > 0 and row["registers"] > 0
