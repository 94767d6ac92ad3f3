"""The device pool of one TP rank: K and V tensors for every layer, addressed by slot.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V, where
``num_kv_heads`` is this rank's share. Slot ``s`` is ``block_id * block_size + offset``; the
views returned by ``layer`` flatten the first two dimensions so a slot indexes a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one rank's KV pool."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV cache {name} must be at least 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (what a block costs on this rank)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


class KVCache:
    """K and V tensors of all layers, allocated once (one tensor, so one registration/copy).

    ``with_scratch_block`` adds one block after the pool's ``num_blocks``, which no sequence ever
    owns: the padded rows of a fixed-size batch (a CUDA graph's) write their K/V there."""

    def __init__(self, spec: KVCacheSpec, device: torch.device,
                 with_scratch_block: bool = False) -> None:
        self.spec = spec
        self.scratch_block: Optional[int] = spec.num_blocks if with_scratch_block else None
        num_blocks = spec.num_blocks + int(with_scratch_block)
        # [num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]
        self.data = torch.zeros(
            spec.num_layers, 2, num_blocks * spec.block_size, spec.num_kv_heads,
            spec.head_dim, dtype=spec.dtype, device=device,
        )

    def layer(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each ``[num_slots, num_kv_heads, head_dim]``."""
        return self.data[index, 0], self.data[index, 1]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at their slots ``[T]``."""
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


def gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` for a ``[num_slots, Hkv, D]`` cache and any shape of ``slots``: one
    ``index_select`` of whole rows, which copies each slot's row at once (advanced indexing
    walks it element by element: 4-5x slower on CPU here)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, slots.reshape(-1))  # [N, Hkv*D]
    return rows.view(*slots.shape, *cache.shape[1:])
