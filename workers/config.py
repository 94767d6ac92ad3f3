"""Engine configuration, validated on construction; errors say what to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a checkpoint directory, or "default"
    tp_size: int = 1
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # caps the device pool; None: from kv_cache_gb
    kv_cache_gb: float = 2.0  # device pool per rank, when num_kv_blocks is None
    enable_prefix_cache: bool = True
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill)
    max_num_seqs: int = 128
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    dtype: str = "auto"  # auto: fp32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"  # auto: CUDA when available, else CPU
    seed: int = 0  # for requests without a seed of their own

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"--tp must be at least 1, got {self.tp_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--kv-blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
