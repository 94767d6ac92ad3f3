"""Kernels one decoder layer launches in a decode step, counted without a GPU.

``count_kernels`` runs a function under a ``TorchDispatchMode`` and counts, by name:

- every aten op that would launch a device kernel: math, copies, reductions, index writes,
  matmuls (one each, though cuBLAS may split one in two);
- every Triton kernel launch (one each), with the torch ops Triton's interpreter runs to stage
  its arguments left uncounted (they are not part of a launch on a GPU).

Not counted, since they launch nothing on a device: views and other metadata-only ops (``view``,
``_unsafe_view``, ``t``, ``transpose``, ``as_strided``, ``slice``, ``select``, ``unsqueeze``,
``expand``, ``split``, ``detach``: every op whose schema makes it a view), and allocations
(``empty``, ``empty_like``, ``new_empty``, ``empty_strided``). A ``reshape`` of a contiguous
tensor reaches the dispatcher as a ``view``; of a non-contiguous one, as a ``clone``, counted.

On CPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before
``triton`` is first imported); on a GPU ``scripts/gpu/fused_kernels.py`` counts the kernels the
CUDA profiler sees instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Counter, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kv.attention.backend import make_attention_backend
from kv.attention.metadata import SeqSlice
from kv.kv_cache import KVCache, KVCacheSpec
from parallel.tp_group import TPGroup
from workers.model_config import ModelConfig, RopeConfig

aten = torch.ops.aten
ALLOCATIONS = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided,
               aten.new_empty_strided}
# Views the schema does not mark as such (they return a tensor sharing storage, no data moved).
METADATA_ONLY = {aten.detach, aten.lift_fresh, aten._reshape_alias, aten.alias,
                 aten._unsafe_view}


def launches_kernel(func) -> bool:
    """Whether the aten op ``func`` launches a device kernel (views and allocations do not)."""
    packet = func.overloadpacket
    return not (func.is_view or packet in ALLOCATIONS or packet in METADATA_ONLY)


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and launches_kernel(func):
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting_triton_launches(mode: _Counting) -> Iterator[None]:
    """Each interpreted Triton launch counted once, as ``triton:<kernel>``; the torch ops the
    interpreter runs to copy its arguments in and out are not counted."""
    from triton.runtime import interpreter

    original = interpreter.GridExecutor.__call__

    def counted(executor, *args, **kwargs):
        if mode.paused:  # a launch from inside a launch: part of it
            return original(executor, *args, **kwargs)
        mode.counts[f"triton:{executor.fn.__name__}"] += 1
        mode.paused = True
        try:
            return original(executor, *args, **kwargs)
        finally:
            mode.paused = False

    interpreter.GridExecutor.__call__ = counted
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = original


def count_kernels(run: Callable[[], object]) -> Counter[str]:
    """The kernels ``run()`` launches, by name (see the module docstring for what counts)."""
    mode = _Counting()
    with _counting_triton_launches(mode), mode:
        run()
    return mode.counts


@dataclass
class DecodeLayerStep:
    """One decoder layer of a Llama-shaped model and a decode step of ``num_seqs`` sequences,
    ready to run (``run``): what the kernel count and the fused-kernel checks drive."""

    model: torch.nn.Module
    kv_cache: KVCache
    metadata: list
    rope: tuple  # the step's cos/sin tables, looked up once a step for every layer
    hidden: torch.Tensor  # [B, hidden]
    residual: Optional[torch.Tensor]  # [B, hidden]: what an earlier layer carries

    def run(self, layer_index: int = 1):
        """Layer ``layer_index``'s forward: ``(hidden, residual)``."""
        layer = self.model.model.layers[layer_index]
        return layer(self.hidden, self.residual, self.metadata[layer_index],
                     *self.kv_cache.layer(layer_index), self.rope)


def small_llama_config(hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                       layers: int = 2) -> ModelConfig:
    """A Llama-3-shaped config, small enough for Triton's interpreter."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=hidden,
        intermediate_size=hidden * 3, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads, rms_norm_eps=1e-5, max_position_embeddings=512,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
        rope=RopeConfig(theta=500000.0), layer_windows=(None,) * layers,
        torch_dtype="float32", eos_token_ids=(2,), bos_token_id=1)


def decode_layer_step(device: torch.device, dtype: torch.dtype, fused: bool,
                      num_seqs: int = 4, context: int = 40, block_size: int = 16,
                      config: Optional[ModelConfig] = None, seed: int = 0) -> DecodeLayerStep:
    """A random model on the Triton attention backend, ``fused`` or not, with ``context`` tokens
    cached for each of ``num_seqs`` sequences (random K/V), and the decode step that follows.
    The decode attention is sized as a CUDA graph sizes it, for the longest context the model
    allows (so it splits, and combines the splits: two kernels)."""
    from workers.models.llama import LlamaForCausalLM

    config = config or small_llama_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, TPGroup(0, 1, device), dtype, config.max_position_embeddings,
                             make_attention_backend("triton"), fused_kernels=fused)
    for param in model.parameters():
        param.data.normal_(0.0, 0.05)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.data.normal_(1.0, 0.1)
    blocks_per_seq = -(-(context + 1) // block_size)
    spec = KVCacheSpec(config.num_layers, num_seqs * blocks_per_seq, block_size,
                       config.num_kv_heads, config.head_dim, dtype)
    kv_cache = KVCache(spec, device, with_scratch_block=True)
    kv_cache.data.normal_()
    seqs = [SeqSlice(1, context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
            for i in range(num_seqs)]
    metadata = [dataclasses.replace(meta, max_decode_keys=config.max_position_embeddings)
                for meta in model.attention.build_metadata(seqs, block_size, device,
                                                           config.layer_windows)]
    hidden = torch.randn(num_seqs, config.hidden_size, device=device).to(dtype)
    residual = torch.randn(num_seqs, config.hidden_size, device=device).to(dtype)
    rope = model.model.rotary.tables(metadata[0].positions)
    return DecodeLayerStep(model, kv_cache, metadata, rope, hidden, residual)
