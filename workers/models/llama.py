"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over tensor-parallel layers and a paged
KV cache. Parameter names follow the Hugging Face checkpoints; q/k/v and gate/up are fused, as
``packed_modules_mapping`` tells the loader."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from kv.attention.backend import AttentionBackend, StepMetadata, TorchAttentionBackend
from kv.kv_cache import KVCache
from parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from parallel.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.tp_group import TPGroup
from parallel.weights import default_weight_loader, set_weight_loader
from workers.model_config import ModelConfig
from workers.models.rope import RotaryEmbedding


_RMS_NORM = getattr(F, "rms_norm", None)  # torch >= 2.4


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and _RMS_NORM is not None:
            # On CPU torch's rms_norm is the expression below, bit for bit, in one call: 8
            # dispatched ops fewer, 2 per layer, on a decode step that dispatches thousands.
            return _RMS_NORM(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 attention: AttentionBackend) -> None:
        super().__init__()
        self.attention = attention
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        config.o_bias, tp, dtype)
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        q_size, k_size, _ = self.qkv_proj.local_sizes
        self.num_q_heads = q_size // config.head_dim  # local
        self.qk_size = q_size + k_size

    def forward(self, hidden: torch.Tensor, metadata: StepMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``rope``: the step's cos/sin tables (`RotaryEmbedding.tables`)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H_local + 2 Hkv_local) * D]: q, k, v side by side
        # q and k rotated in one pass: [T, H_local + Hkv_local, D]
        qk = RotaryEmbedding.rotate(qkv[:, :self.qk_size].view(num_tokens, -1, self.head_dim),
                                    rope)
        q, k = qk[:, :self.num_q_heads], qk[:, self.num_q_heads:]
        v = qkv[:, self.qk_size:].view(num_tokens, -1, self.head_dim)
        # Writes k/v into the cache, then attends: [T, H_local*D]
        out = self.attention.forward(q, k, v, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size],
                                                 config.mlp_bias, tp, dtype)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I_local] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 attention: AttentionBackend) -> None:
        super().__init__()
        eps, device = config.rms_norm_eps, tp.device
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(config, tp, dtype, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(config, tp, dtype)

    def forward(self, hidden: torch.Tensor, metadata: StepMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), metadata, k_cache, v_cache,
                                         rope)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 max_positions: int, attention: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, tp.device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, dtype, attention)
            for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, tp.device)


class LlamaForCausalLM(nn.Module):
    """``forward`` runs the step's flat batch of new tokens; ``compute_logits`` the LM head."""

    # checkpoint module name -> (our fused module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 max_positions: int, attention: Optional[AttentionBackend] = None) -> None:
        """``attention``: the backend every layer attends with (default: the torch one)."""
        super().__init__()
        self.config = config
        self.tp = tp  # its collectives' timer times them inside captured graphs too
        self.attention = attention or TorchAttentionBackend()
        self.model = LlamaModel(config, tp, dtype, max_positions, self.attention)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, metadata: Sequence[StepMetadata],
                kv_cache: KVCache) -> torch.Tensor:
        """``metadata[i]`` holds layer i's indices: layers differ by their sliding window."""
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.model.rotary.tables(metadata[0].positions)  # every layer's positions
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, metadata[index], *kv_cache.layer(index), rope)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """``[N, vocab]`` logits on rank 0, None on the other ranks."""
        return self.lm_head(hidden)
