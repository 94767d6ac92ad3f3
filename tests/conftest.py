import os

# Nothing may be fetched from a model hub in tests: checkpoints are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (with a BPE tokenizer and chat template)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
