"""Attention backends behind one interface, chosen by ``--attention-backend``.

A backend builds the per-step metadata its kernels need (once per distinct sliding window, shared
by the layers with that window) and, per layer, writes the step's new K/V into the paged cache and
attends the step's queries over it (``forward``), or attends alone once the model wrote them
itself, fused with its RoPE (``attend``):

- ``torch``: plain PyTorch (``kv/attention/torch_paged.py``): gathers K/V into padded dense tensors. The
  reference, and the default on CPU.
- ``triton``: Triton kernels that read K/V straight from the cache through the block table
  (``kv/attention/triton_paged.py``). The default on CUDA. On CPU it runs only under Triton's
  interpreter (``TRITON_INTERPRET=1``: slow, for tests). ``triton`` is imported only when this
  backend is built, so the engine runs without it on the torch backend.

``resolve_attention_backend`` turns the flag's value into a backend name for a device, with errors
that name the flag; ``make_attention_backend`` builds one by name (on any rank).
"""

from __future__ import annotations

import importlib
import logging
import os
from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from kv.attention.metadata import (DECODE_BUCKET_SIZE, AttentionMetadata, SeqSlice,
                                   build_layer_metadata)
from kv.attention.block_table_metadata import BlockTableMetadata, build_block_table_metadata
from kv.attention.cpu_decode import decode_kernel
from kv.kv_cache import KVCache, write_kv
from kv.attention.torch_paged import CUDA_FLASH_DTYPES, SDPA_HAS_GQA, paged_attention

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "triton")
StepMetadata = Union[AttentionMetadata, BlockTableMetadata]


class AttentionBackend(ABC):
    """Writes and reads the paged KV cache of one rank; one instance serves every layer."""

    name: str
    # True: the model runner keeps block tables on the device (``DeviceBlockTables``) and builds
    # each step's metadata there (``build_device_step``); False: ``build_metadata`` from lists.
    reads_block_tables: bool = False

    @abstractmethod
    def build_metadata(self, seqs: Sequence[SeqSlice], block_size: int, device: torch.device,
                       layer_windows: Sequence[Optional[int]]) -> List[StepMetadata]:
        """Metadata for each layer of a step (layer i's window is ``layer_windows[i]``); every
        object has ``positions`` and ``slot_mapping`` ``[T]``."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: StepMetadata,
                scale: float) -> torch.Tensor:
        """Store ``key``/``value`` ``[T, Hkv, D]`` at their slots of ``k_cache``/``v_cache``
        ``[num_slots, Hkv, D]``, then attend ``query`` ``[T, H, D]``; returns ``[T, H * D]``."""
        write_kv(k_cache, v_cache, key, value, metadata.slot_mapping)
        return self.attend(query, key, value, k_cache, v_cache, metadata, scale)

    @abstractmethod
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: StepMetadata,
               scale: float) -> torch.Tensor:
        """``forward`` once the step's ``key``/``value`` are in the cache (a model that writes
        them itself, fused with its RoPE, calls this): ``[T, H * D]``."""

    def prepare(self, kv_cache: KVCache, num_heads: int) -> None:
        """Called once a rank's cache exists (``num_heads``: the model's query heads), before its
        first step: a backend loads what its steps need here."""


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch reference: runs wherever torch does. On CPU, decodes run on the C kernel
    (``kv/attention/cpu_decode.py``) where it takes the cache: then all of a step's decodes form one
    bucket, attended in one kernel call per layer (the kernel skips masked keys unread, so a
    bucket's padding costs it nothing; measured on SmolLM2-135M's decode-heavy workload,
    docs/benchmarks/cpu-decode.md)."""

    name = "torch"

    def __init__(self) -> None:
        self.decode_bucket_size: Optional[int] = DECODE_BUCKET_SIZE

    def prepare(self, kv_cache: KVCache, num_heads: int) -> None:
        if kv_cache.data.device.type != "cpu":
            return
        kernel = decode_kernel()  # compiled or loaded now, not in the rank's first decode
        k_cache, v_cache = kv_cache.layer(0)
        query = k_cache.new_empty(1, num_heads, k_cache.shape[-1])
        if kernel is not None and kernel.accepts(query, k_cache, v_cache):
            self.decode_bucket_size = None

    def build_metadata(self, seqs: Sequence[SeqSlice], block_size: int, device: torch.device,
                       layer_windows: Sequence[Optional[int]]) -> List[StepMetadata]:
        return list(build_layer_metadata(seqs, block_size, device, layer_windows,
                                         self.decode_bucket_size))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: StepMetadata,
               scale: float) -> torch.Tensor:
        assert isinstance(metadata, AttentionMetadata)
        return paged_attention(query, k_cache, v_cache, metadata, scale)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels over the block table. ``sdpa_fresh_prefills`` (default: on CUDA in fp16 or
    bf16, ``sdpa_for_fresh_prefills``) runs the prefills with nothing cached through
    ``scaled_dot_product_attention`` on their new K/V (FlashAttention or cuDNN there), the rest
    through the paged kernels."""

    name = "triton"
    reads_block_tables = True

    def __init__(self, sdpa_fresh_prefills: Optional[bool] = None) -> None:
        self._kernels = importlib.import_module("kv.attention.triton_paged")
        self._sdpa_fresh_prefills = sdpa_fresh_prefills

    def build_metadata(self, seqs: Sequence[SeqSlice], block_size: int, device: torch.device,
                       layer_windows: Sequence[Optional[int]]) -> List[StepMetadata]:
        return list(build_block_table_metadata(seqs, block_size, device, layer_windows))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: StepMetadata,
               scale: float) -> torch.Tensor:
        assert isinstance(metadata, BlockTableMetadata)
        num_tokens, num_heads, head_dim = query.shape
        out = query.new_empty(num_tokens, num_heads * head_dim)  # [T, H*D]
        if metadata.num_decodes:
            self._kernels.paged_decode(query, k_cache, v_cache, metadata, scale, out)
        prefill_ids = metadata.prefill_ids
        if self._use_sdpa(query) and metadata.fresh_prefills:
            for start, end in metadata.fresh_prefills:
                out[start:end] = _causal_sdpa(query[start:end], key[start:end],
                                              value[start:end], scale)
            prefill_ids = metadata.cached_prefill_ids
        if prefill_ids.shape[0]:
            self._kernels.paged_prefill(query, k_cache, v_cache, metadata, prefill_ids, scale,
                                        out)
        return out

    def _use_sdpa(self, query: torch.Tensor) -> bool:
        if self._sdpa_fresh_prefills is None:
            return sdpa_for_fresh_prefills(query.device.type, query.dtype)
        return self._sdpa_fresh_prefills


def sdpa_for_fresh_prefills(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the Triton backend's default sends prefills with nothing cached to SDPA: where
    FlashAttention takes GQA (``CUDA_FLASH_DTYPES``, torch 2.5 on). An fp32 call with GQA would
    fall to SDPA's math backend and its whole [H, L, L] score matrix; the paged prefill kernel
    attends fp32 by tiles."""
    return device_type == "cuda" and SDPA_HAS_GQA and dtype in CUDA_FLASH_DTYPES


def _causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Causal attention of one sequence's ``query`` ``[L, H, D]`` over its own ``key``/``value``
    ``[L, Hkv, D]``; returns ``[L, H * D]``."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
        is_causal=True, scale=scale, enable_gqa=True)  # [1, H, L, D]
    return out[0].transpose(0, 1).reshape(query.shape[0], -1)


def _import_triton_error() -> Optional[str]:
    """Why ``triton`` cannot be imported, or None if it can."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return str(exc)
    return None


def _triton_interprets() -> bool:
    import triton

    knobs = getattr(triton, "knobs", None)  # triton 3.3 on; before, the variable alone
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_triton_usable(device: torch.device) -> None:
    """Raise ``ValueError`` saying what to do if the triton backend cannot run on ``device``."""
    reason = _import_triton_error()
    if reason is not None:
        raise ValueError(f"--attention-backend triton needs the triton package ({reason}): "
                         f"install it (pip install triton) or use --attention-backend torch")
    if device.type != "cuda" and not _triton_interprets():
        raise ValueError(f"--attention-backend triton compiles for GPUs only; on {device.type} "
                         f"set TRITON_INTERPRET=1 to run its kernels in Triton's interpreter "
                         f"(slow: for tests) or use --attention-backend torch")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend to run for the flag value ``name`` on ``device``: ``auto`` is triton on CUDA
    (torch if triton is missing there, with a warning) and torch elsewhere."""
    if name not in ("auto",) + ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be auto, torch or triton, got {name!r}")
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        reason = _import_triton_error()
        if reason is None:
            return "triton"
        logger.warning("attention falls back to torch: triton cannot be imported (%s)", reason)
        return "torch"
    if name == "triton":
        check_triton_usable(device)
    return name


def make_attention_backend(name: str) -> AttentionBackend:
    """Build the backend ``name`` (torch or triton), as resolved on rank 0."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"--attention-backend must be torch or triton here, got {name!r}")
