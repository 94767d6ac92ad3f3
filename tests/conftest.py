import os

# Nothing may be fetched from a model hub in tests: checkpoints are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton runs CPU tensors under its interpreter only, and reads the switch when it is first
# imported: set here, before any test module (transformers imports triton too), so the order
# test files are collected in cannot leave the kernels compiled for a GPU on a machine without
# one. A machine with CUDA tests the kernels compiled.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (with a BPE tokenizer and chat template)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
