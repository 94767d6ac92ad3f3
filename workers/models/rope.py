"""Rotary position embeddings (default, linear and llama3 scaling), computed as transformers does
so that our activations match its, bit for bit in fp32."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn

from workers.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """``[head_dim / 2]`` inverse frequencies in fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope, max_positions)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_positions
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables: ``tables`` looks up a step's positions once, ``rotate`` turns
    q ``[T, H, D]`` and k ``[T, Hkv, D]`` (or both side by side) by them."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim, max_positions)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, D]
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)

    def tables(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, D]`` of the step's positions: looked up once per step and
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, tables: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` rotated: any heads, q's and k's side by side included (the
        same elementwise expression as for each alone, so the same bits)."""
        cos, sin = tables
        return x * cos + _rotate_half(x) * sin
