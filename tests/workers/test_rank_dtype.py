"""The dtype a rank computes in: ``auto`` is bf16 on a CPU with bf16 instructions and fp32 on
one without, follows the checkpoint on CUDA, and is float16 where a GPU has no bfloat16;
bfloat16 asked for on a CPU without bf16 instructions runs with a warning."""

import logging

import pytest
import torch


@pytest.mark.parametrize("asked, checkpoint, device, bf16, want", [
    ("auto", "bfloat16", "cpu", False, torch.float32),  # no bf16 instructions
    ("auto", "float32", "cpu", False, torch.float32),
    ("auto", "float32", "cpu", True, torch.bfloat16),  # AMX or AVX-512 BF16
    ("auto", "bfloat16", "cpu", True, torch.bfloat16),
    ("float32", "bfloat16", "cpu", True, torch.float32),
    ("bfloat16", "float32", "cpu", False, torch.bfloat16),  # asked for: slow, but runs
    ("auto", "bfloat16", "cuda", True, torch.bfloat16),
    ("auto", "float32", "cuda", True, torch.float32),
    ("auto", "bfloat16", "cuda", False, torch.float16),  # T4, V100: no bf16
    ("auto", "float16", "cuda", False, torch.float16),
    ("float32", "bfloat16", "cuda", False, torch.float32),
])
def test_the_auto_dtype_follows_the_device(asked, checkpoint, device, bf16, want):
    from workers.rank import resolve_dtype

    assert resolve_dtype(asked, torch.device(device), checkpoint, bf16_supported=bf16) is want


def test_auto_on_this_cpu_follows_its_probe():
    from parallel.cpu_capability import cpu_bf16_support
    from workers.rank import resolve_dtype

    want = torch.bfloat16 if cpu_bf16_support().is_fast else torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), "float32") is want


@pytest.mark.parametrize("fast", [False, True])
def test_bfloat16_on_a_cpu_without_bf16_instructions_warns_that_it_is_slow(caplog, fast):
    from workers.rank import resolve_dtype

    with caplog.at_level(logging.INFO, logger="workers.rank"):
        resolve_dtype("bfloat16", torch.device("cpu"), "float32", bf16_supported=fast)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if fast:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "no bf16 instructions" in warnings[0]
        assert "slower than float32" in warnings[0]


def test_bfloat16_asked_for_on_a_gpu_without_it_is_refused_by_name():
    from workers.rank import resolve_dtype

    with pytest.raises(ValueError, match="dtype bfloat16: this GPU has no bfloat16"):
        resolve_dtype("bfloat16", torch.device("cuda"), "float32", bf16_supported=False)


def test_a_dtype_that_is_not_a_float_is_refused_by_name():
    from workers.rank import resolve_dtype

    with pytest.raises(ValueError, match="dtype 'int8' is not a torch floating dtype"):
        resolve_dtype("int8", torch.device("cpu"), "float32", bf16_supported=True)
