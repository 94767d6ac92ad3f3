"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over tensor-parallel layers and a paged
KV cache. Parameter names follow the Hugging Face checkpoints; q/k/v and gate/up are fused, as
``packed_modules_mapping`` tells the loader."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from kv.attention.backend import AttentionBackend, StepMetadata, TorchAttentionBackend
from kv.kv_cache import KVCache
from parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from parallel.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.tp_group import TPGroup
from parallel.weights import default_weight_loader, set_weight_loader
from workers.model_config import ModelConfig
from workers.models.layer_ops import LayerOps, layer_ops, rms_norm
from workers.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 attention: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.attention, self.ops = attention, ops
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_heads,
                                          config.num_kv_heads, config.qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        config.o_bias, tp, dtype)
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        q_size, k_size, _ = self.qkv_proj.local_sizes
        self.num_q_heads = q_size // config.head_dim  # local
        self.num_kv_heads = k_size // config.head_dim  # local

    def forward(self, hidden: torch.Tensor, metadata: StepMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``rope``: the step's cos/sin tables (`RotaryEmbedding.tables`)."""
        qkv = self.qkv_proj(hidden)  # [T, (H_local + 2 Hkv_local) * D]: q, k, v side by side
        # q [T, H_local, D] and k [T, Hkv_local, D] rotated; k and v written into the cache
        q, k, v = self.ops.rope_write_kv(qkv, rope, k_cache, v_cache, metadata.slot_mapping,
                                         self.num_q_heads, self.num_kv_heads)
        out = self.attention.attend(q, k, v, k_cache, v_cache, metadata, self.scale)  # [T, H*D]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size],
                                                 config.mlp_bias, tp, dtype)
        self.down_proj = RowParallelLinear(size, config.hidden_size, config.mlp_bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, 2 I_local] -> [T, I_local] -> [T, hidden]
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Takes and returns ``(hidden, residual)``: the residual sum a layer leaves is completed by
    the next norm (the next layer's, or the model's last), which adds and normalises in one op."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 attention: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        eps, device = config.rms_norm_eps, tp.device
        self.ops = ops
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(config, tp, dtype, attention, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(config, tp, dtype, ops)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                metadata: StepMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` ``[T, hidden]``: the last layer's output (the embeddings for the first, whose
        ``residual`` is None); the layer's input is ``hidden + residual``."""
        norm = self.input_layernorm
        x, residual = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn(x, metadata, k_cache, v_cache, rope)
        norm = self.post_attention_layernorm
        x, residual = self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 max_positions: int, attention: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, tp.device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, dtype, attention, ops)
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
                 max_positions: int, attention: Optional[AttentionBackend] = None,
                 fused_kernels: Optional[bool] = None) -> None:
        """``attention``: the backend every layer attends with (default: the torch one);
        ``fused_kernels``: the layers' elementwise ops as Triton kernels (True) or PyTorch
        expressions (False); None: Triton on CUDA in 16-bit dtypes, C kernels on CPU in bf16
        (`workers.models.layer_ops.layer_ops`)."""
        super().__init__()
        self.config = config
        self.tp = tp  # its collectives' timer times them inside captured graphs too
        self.attention = attention or TorchAttentionBackend()
        self.ops = layer_ops(tp.device, dtype, fused_kernels)
        self.model = LlamaModel(config, tp, dtype, max_positions, self.attention, self.ops)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, metadata: Sequence[StepMetadata],
                kv_cache: KVCache) -> torch.Tensor:
        """``metadata[i]`` holds layer i's indices: layers differ by their sliding window."""
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.model.rotary.tables(metadata[0].positions)  # every layer's positions
        residual = None
        for index, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, metadata[index], *kv_cache.layer(index),
                                     rope)
        norm = self.model.norm
        return self.ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor,
                       out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``[N, vocab]`` logits on rank 0 (written into ``out`` when given), None on the other
        ranks (`parallel.embedding.ParallelLMHead`)."""
        return self.lm_head(hidden, out)
