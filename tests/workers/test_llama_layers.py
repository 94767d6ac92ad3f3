"""The Llama layers' small ops, bit for bit against transformers' own modules in fp32: RMSNorm
(torch's ``rms_norm`` on CPU, the spelled-out expression elsewhere) and rotary embeddings
(q and k rotated side by side in one pass, with the step's cos/sin tables looked up once)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from workers.model_config import RopeConfig
from workers.models.llama import RMSNorm
from workers.models.rope import RotaryEmbedding

CPU = torch.device("cpu")


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_equals_transformers_bit_for_bit(tokens, hidden):
    torch.manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden) * 3
    ours = RMSNorm(hidden, 1e-5, torch.float32, CPU)
    theirs = hf.LlamaRMSNorm(hidden, eps=1e-5)
    weight = torch.randn(hidden)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    assert torch.equal(ours(x), theirs(x))


def test_rms_norm_spelled_out_path_equals_the_fused_one():
    x = torch.randn(5, 96)
    norm = RMSNorm(96, 1e-6, torch.float32, CPU)
    norm.weight.data.normal_()
    fused = norm(x)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # what CUDA runs
    assert torch.equal(fused, norm.weight * h)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_q_and_k_rotated_together_equal_transformers(heads, kv_heads):
    head_dim, tokens = 32, 9
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=256,
                         rope_theta=10000.0)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 256, torch.float32, CPU)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 101, 200, 255])
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim)
    both = rotary.rotate(torch.cat([q, k], dim=1), rotary.tables(positions))
    ours_q, ours_k = both[:, :heads], both[:, heads:]
    cos, sin = hf.LlamaRotaryEmbedding(config=config)(q, positions[None])  # [1, T, D]
    # transformers' layout is [batch, heads, T, D]
    hf_q, hf_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         cos, sin)
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))
    tables = rotary.tables(positions)  # each rotated alone: the same bits as side by side
    assert torch.equal(rotary.rotate(q, tables), ours_q)
    assert torch.equal(rotary.rotate(k, tables), ours_k)

