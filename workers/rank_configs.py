"""Every rank's configuration, derived in one place from the engine's configuration and model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch

from kv.attention.backend import resolve_attention_backend
from parallel.rendezvous import RendezvousSocket
from parallel.tp_group import TPGroupConfig
from workers.config import EngineConfig
from workers.engine_sizing import block_spec, size_pool
from workers.model_config import ModelConfig
from workers.rank import RankConfig, resolve_dtype
from workers.tier_setup import RankTierConfig, claim_engine_dir, model_identity, tier_sizes


@dataclass(frozen=True)
class RankConfigs:
    ranks: List[RankConfig]  # rank 0 first
    max_model_len: int  # the context, fitted to the pool
    disk_lock: Optional[Any]  # this engine's claim on a directory under --disk-kv-dir


def rank_configs(cfg: EngineConfig, model_dir: Path, model: ModelConfig, max_model_len: int,
                 rendezvous: Optional[RendezvousSocket], bind_cores: bool = False) -> RankConfigs:
    """The configs of ranks 0..N-1: device, dtype, pool size, attention backend, KV tiers (a
    disk tier claims its directories here: the caller releases ``disk_lock``); ``bind_cores``:
    CPU ranks run on cores of their own (each rank in a process of its own)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = resolve_dtype(cfg.dtype, device, model.torch_dtype)
    attention = resolve_attention_backend(cfg.attention_backend, device)
    num_blocks, max_model_len = size_pool(cfg, model, dtype, max_model_len, use_cuda)
    init = rendezvous.init_method if rendezvous is not None else None
    threads = None if use_cuda else max(1, (torch.get_num_threads()) // cfg.tp_size)
    dtype_name = str(dtype).replace("torch.", "")
    tiers, disk_lock = _rank_tier_config(cfg, model_dir, model, dtype, dtype_name)
    ranks = [
        RankConfig(str(model_dir),
                   TPGroupConfig(rank, cfg.tp_size, init, timeout_s=cfg.step_timeout_s,
                                 listen_fd=(rendezvous.fileno()
                                            if rank == 0 and rendezvous else None)),
                   f"cuda:{rank}" if use_cuda else "cpu", dtype_name,
                   num_blocks, cfg.block_size, max_model_len, threads, tiers,
                   attention_backend=attention, cuda_graphs=not cfg.enforce_eager,
                   max_num_seqs=cfg.max_num_seqs,
                   gpu_memory_utilization=cfg.gpu_memory_utilization,
                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                   bind_cores=bind_cores and not use_cuda, nice=cfg.cpu_rank_nice)
        for rank in range(cfg.tp_size)
    ]
    return RankConfigs(ranks, max_model_len, disk_lock)


def _rank_tier_config(cfg: EngineConfig, model_dir: Path, model: ModelConfig, dtype: torch.dtype,
                      dtype_name: str) -> Tuple[Optional[RankTierConfig], Optional[Any]]:
    if not cfg.has_host_tier:
        return None, None
    block_bytes = block_spec(cfg, model, dtype).bytes_per_block
    num_host, num_disk = tier_sizes(cfg, block_bytes)
    identity = model_identity(model_dir, dtype_name, cfg.block_size, cfg.tp_size)
    engine_dirs: Tuple[str, ...] = ()
    disk_lock = None
    if cfg.disk_kv_dir is not None:  # the same engine<i> in every directory, all locked
        paths, disk_lock = claim_engine_dir(cfg.disk_kv_dirs)
        engine_dirs = tuple(str(path) for path in paths)
    return (RankTierConfig(num_host, engine_dirs[0] if engine_dirs else None, num_disk,
                           identity, engine_dirs[1:], block_bytes), disk_lock)
