"""What an engine's configuration means for one checkpoint, decided before any rank starts:
the checks a bad configuration fails, the context length, and the size of the KV pool.

Pure (files read, nothing started), so the serving CLI runs the same checks before it deploys.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Tuple

import torch

from kv.kv_cache import KVCacheSpec
from workers.config import EngineConfig
from workers.default_model import resolve_model_path
from workers.loader import checkpoint_files
from workers.model_config import ModelConfig, load_model_config

logger = logging.getLogger(__name__)

_MAX_KV_BLOCKS = 1 << 17  # Python block objects stay cheap below this


def check_model(config: EngineConfig) -> Tuple[Path, ModelConfig]:
    """The checkpoint directory and its config, after the checks every rank would fail: TP
    divides the heads, the context fits the positions, the shards are there. Raises
    ``ValueError`` / ``OSError`` naming the problem."""
    model_dir = resolve_model_path(config.model)
    model = load_model_config(model_dir)
    model.check_tp_size(config.tp_size)
    context_length(config, model)
    checkpoint_files(model_dir)
    return model_dir, model


def context_length(config: EngineConfig, model: ModelConfig) -> int:
    """The context the user asked for, or the model's; at most the model's."""
    model_max = model.max_position_embeddings
    wanted = config.max_model_len or model_max
    if wanted > model_max:
        raise ValueError(f"--max-model-len {wanted} exceeds the model's "
                         f"max_position_embeddings ({model_max})")
    return wanted


def block_spec(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> KVCacheSpec:
    """One block of one rank's KV pool."""
    kv_heads = max(1, model.num_kv_heads // config.tp_size)
    return KVCacheSpec(model.num_layers, 1, config.block_size, kv_heads, model.head_dim, dtype)


def default_num_blocks(config: EngineConfig, model: ModelConfig, dtype: torch.dtype,
                       max_model_len: int) -> int:
    """What ``kv_cache_gb`` allows, at most ``max_num_seqs`` full-length sequences; possibly
    less than one (``fit_context_to_pool`` then lowers the context or refuses)."""
    by_memory = int(config.kv_cache_gb * (1 << 30)) // block_spec(config, model,
                                                                  dtype).bytes_per_block
    return max(1, min(by_memory, max_pool_blocks(config, max_model_len)))


def size_pool(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, max_model_len: int,
              use_cuda: bool) -> Tuple[int, int]:
    """The device pool's blocks per rank and the context fitted to it. With
    ``--gpu-memory-utilization`` the ranks size the pool once the weights are loaded
    (`workers.memory_profile`): the blocks returned are then the cap, and the engine fits the
    context to what the ranks found."""
    if config.gpu_memory_utilization is None:
        num_blocks = config.num_kv_blocks or default_num_blocks(config, model, dtype,
                                                                max_model_len)
        return num_blocks, fit_context_to_pool(config, max_model_len, num_blocks)
    if not use_cuda:
        raise ValueError(
            f"--gpu-memory-utilization {config.gpu_memory_utilization:g} sizes the KV pool "
            f"from a CUDA device's free memory, and this engine runs on the CPU: size it with "
            f"--kv-cache-gb or --kv-blocks")
    return config.num_kv_blocks or max_pool_blocks(config, max_model_len), max_model_len


def max_pool_blocks(config: EngineConfig, max_model_len: int) -> int:
    """The most blocks a pool is given however much memory there is: ``max_num_seqs``
    full-length sequences, and few enough for the block manager's Python objects."""
    per_seq = -(-max_model_len // config.block_size)
    return min(per_seq * config.max_num_seqs, _MAX_KV_BLOCKS)


def fit_context_to_pool(config: EngineConfig, wanted: int, num_blocks: int) -> int:
    """``wanted`` when a pool of ``num_blocks`` holds one sequence that long, so that a request
    alone always fits. Otherwise a context taken from the model is lowered to what the pool
    holds (with a warning), and one the user chose raises ``ValueError``."""
    pool_tokens = num_blocks * config.block_size
    if pool_tokens >= wanted:
        return wanted
    by_fraction = sized_by_fraction(config, num_blocks)
    pool = (f"the KV pool ({pool_source(config, by_fraction)}: {num_blocks} blocks of "
            f"{config.block_size} tokens) holds {pool_tokens} tokens")
    if by_fraction:
        fix = "raise --gpu-memory-utilization (or --tp: each rank then holds less of the model)"
    else:
        fix = f"set --kv-blocks to at least {-(-wanted // config.block_size)}"
        if config.num_kv_blocks is None:
            fix += " (or raise --kv-cache-gb)"
    if config.max_model_len is not None:
        raise ValueError(f"--max-model-len {wanted} does not fit: {pool}, fewer than one "
                         f"sequence of {wanted}; {fix}, or --max-model-len to at most "
                         f"{pool_tokens}")
    if pool_tokens < 2:
        raise ValueError(f"{pool}: a request needs at least 2 (a prompt token and an "
                         f"output); {fix}")
    logger.warning("%s, fewer than the model's context of %d: max_model_len lowered to %d; "
                   "%s for the full context", pool, wanted, pool_tokens, fix)
    return pool_tokens


def sized_by_fraction(config: EngineConfig, num_blocks: int) -> bool:
    """Whether ``--gpu-memory-utilization`` decided a pool of ``num_blocks`` (not its cap)."""
    capped = config.num_kv_blocks is not None and num_blocks >= config.num_kv_blocks
    return config.gpu_memory_utilization is not None and not capped


def pool_source(config: EngineConfig, by_fraction: bool) -> str:
    """The option that sized the pool, as the user wrote it."""
    if by_fraction:
        return f"--gpu-memory-utilization {config.gpu_memory_utilization:g}"
    if config.num_kv_blocks is not None:
        return f"--kv-blocks {config.num_kv_blocks}"
    return f"--kv-cache-gb {config.kv_cache_gb:g}"
