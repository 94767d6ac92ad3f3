"""The dtype a rank computes in: ``auto`` follows the checkpoint on CUDA, fp32 on CPU, and
float16 where a GPU has no bfloat16."""

import pytest
import torch


@pytest.mark.parametrize("asked, checkpoint, device, bf16, want", [
    ("auto", "bfloat16", "cpu", None, torch.float32),  # no fast bf16 on CPU
    ("auto", "bfloat16", "cuda", True, torch.bfloat16),
    ("auto", "bfloat16", "cuda", False, torch.float16),  # T4, V100: no bf16
    ("auto", "float16", "cuda", False, torch.float16),
    ("float32", "bfloat16", "cuda", False, torch.float32),
])
def test_the_auto_dtype_follows_the_checkpoint_and_what_the_gpu_has(asked, checkpoint, device,
                                                                    bf16, want):
    from workers.rank import resolve_dtype

    assert resolve_dtype(asked, torch.device(device), checkpoint, bf16_supported=bf16) is want


def test_bfloat16_asked_for_on_a_gpu_without_it_is_refused_by_name():
    from workers.rank import resolve_dtype

    with pytest.raises(ValueError, match="dtype bfloat16: this GPU has no bfloat16"):
        resolve_dtype("bfloat16", torch.device("cuda"), "float32", bf16_supported=False)
