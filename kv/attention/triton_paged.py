"""Paged attention kernels in Triton: K/V are read straight from the paged cache through the block
table, never gathered into dense tensors. Imported only when the ``triton`` backend is chosen.

- Decode (one new token per sequence), flash-decoding style: one program per (sequence, KV head,
  split). The ``G`` query heads that share a KV head are the rows of one tile, ``[G, D]``
  (``G`` rounded up to a power of two, nothing more), so each K/V tile is read once for its
  whole group (GQA and MQA without repeating K/V). Splits let a few long sequences still fill
  the GPU: each leaves an unnormalised partial output with its running max and sum, and a
  second kernel combines them. With one split (short contexts, or enough sequences to fill the
  GPU) the first kernel writes the output itself.
  The number of splits ``S`` is part of the launch (fixed per captured CUDA graph size); which
  keys a split walks is not: each program cuts its own sequence's visible keys, read from the
  device, into ``S`` runs of whole tiles (`decode_split_range`)::

      keys of seq b:  [first .................................. context_len)
      tiles:          ceil(num_keys / BLOCK_N), ceil(tiles / S) of them per split
      split s:        [first + s * split_len, min(first + (s + 1) * split_len, context_len))

  so a 300-key context under a graph sized for 8,192 keys is spread over 5 splits of one tile,
  and the programs past its last key exit at once (the combine kernel skips them the same way).
- Prefill over a cached prefix: one program per (sequence, tile of its new tokens, query head);
  query head ``h`` reads KV head ``h // G``. The chunk's queries attend causally to the cached
  keys and to the new keys before them.

Both walk the keys in tiles of ``BLOCK_N`` positions and look up each position's slot in the
block table, so a tile may span several cache blocks or part of one. With a sliding window the
walk starts at the first position the tile's queries can see: blocks wholly before it are never
read (their slots may hold anything, even NaN, once the scheduler freed them).

Cost: decode reads each visible K/V row once per KV head; prefill once per query head and tile of
``BLOCK_M`` queries. Scores accumulate in fp32 with an online softmax.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from kv.attention.block_table_metadata import BlockTableMetadata

DECODE_BLOCK_N = 64  # keys per decode tile, and the unit a decode split is cut in
# Warps per decode program. fp32 takes 8: its tl.dot runs on CUDA cores with tiles in registers,
# and 4 warps spilled on sm_90 at 64 keys (MQA, 16 query rows, head dim 128: 1 KB, 255
# registers; 128 registers at head dim 128 for the other shapes). 8 warps: at most 64, no spills.
DECODE_NUM_WARPS = 4
DECODE_NUM_WARPS_FP32 = 8
PREFILL_BLOCK_N = 32  # keys per prefill tile
# Query rows per prefill program. fp32 (the exact-parity runs) takes 16: its tl.dot runs on CUDA
# cores with tiles in registers, and 32 or 64 rows spilled on sm_90 (`ptxas -v` through
# scripts/check_gpu_kernels.py: 64 rows spilled 1.2 KB at head dim 64 and 39.5 KB at 128;
# 32 rows 1.7 KB at 128; 16 rows none, 72 and 114 registers). 16-bit inputs take 64 (95 and
# 168 registers, no spills).
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_M_FP32 = 16
MIN_SPLIT_KEYS = 256  # splits are counted so the longest context gives each this many keys
TARGET_PROGRAMS = 512  # decode programs worth launching (an H200 has 132 SMs)


def decode_split_range(first, context_len, split, num_splits, BLOCK_N):
    """Keys ``[start, end)`` that split ``split`` of ``num_splits`` walks for a decode whose
    visible keys are ``[first, context_len)``: the keys cut into tiles of ``BLOCK_N``, and the
    tiles into ``num_splits`` runs of ``ceil(tiles / num_splits)``. Empty (``start >= end``) for
    the splits past the last key. So a program visits at most ``ceil(tiles / num_splits)`` tiles
    of its own context, however long the longest context the launch was sized for.

    Plain integer arithmetic (non-negative, so Triton's truncating ``//`` is Python's): the
    split kernel runs this very function, jitted as `_decode_split_range`, and it is tested on
    plain ints."""
    num_tiles = (context_len - first + BLOCK_N - 1) // BLOCK_N
    split_len = (num_tiles + num_splits - 1) // num_splits * BLOCK_N
    start = first + split * split_len
    end = min(start + split_len, context_len)
    return start, end


def decode_num_nonempty_splits(first, context_len, num_splits, BLOCK_N):
    """How many of the first splits of `decode_split_range` hold keys (the rest are empty); the
    combine kernel runs it jitted, as `_decode_num_nonempty_splits`."""
    num_tiles = (context_len - first + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    return (num_tiles + tiles_per_split - 1) // tiles_per_split


_decode_split_range = triton.jit(decode_split_range)
_decode_num_nonempty_splits = triton.jit(decode_num_nonempty_splits)


@triton.jit
def _first_decode_key(context_len, window, HAS_WINDOW: tl.constexpr):
    """The first key a decode at position ``context_len - 1`` sees."""
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    return first


@triton.jit
def _load_kv_tile(cache_ptr, block_table_row, key_pos, key_ok, kv_head, offs_d, d_ok,
                  stride_slot, stride_head, PAGE: tl.constexpr):
    """``[N, D]`` rows of ``cache`` at positions ``key_pos`` of one sequence; 0 where masked."""
    block = tl.load(block_table_row + key_pos // PAGE, mask=key_ok, other=0)  # [N]
    slot = block.to(tl.int64) * PAGE + key_pos % PAGE  # [N]
    ptrs = cache_ptr + slot[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
    return tl.load(ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax update of rows ``q`` ``[M, D]`` with a K/V tile ``[N, D]``."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [M, N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    # A row that has seen no visible key yet keeps -inf; subtract 0 then, not -inf (NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)  # [M]
    p = tl.exp(s - m_safe[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Ints that change with the step (the window's value, the split count, the step's block-table
# width) are not specialized on: Triton would otherwise compile a kernel again whenever one of
# them turns 1 or a multiple of 16 (a second or two each, mid-traffic).
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, decode_ids_ptr, query_start_ptr,
    context_len_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale, window, num_splits,
    stride_qt, stride_qh, stride_slot, stride_head, stride_bt, stride_ot,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One split of one decode's context for the query heads of one KV head. With a single
    split the output is final and goes straight to ``out``; else to the partial buffers. A
    split past the sequence's last key returns at once and writes nothing."""
    decode, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(decode_ids_ptr + decode)
    context_len = tl.load(context_len_ptr + seq)
    first = _first_decode_key(context_len, window, HAS_WINDOW)
    start, end = _decode_split_range(first, context_len, split, num_splits, BLOCK_N)
    if start >= end:  # never with one split: a decode sees at least its own key
        return
    row = tl.load(query_start_ptr + seq)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_ok, d_ok = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # [G]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        key_pos = tile + tl.arange(0, BLOCK_N)  # [N]
        key_ok = key_pos < end
        k = _load_kv_tile(k_cache_ptr, table_row, key_pos, key_ok, kv_head, offs_d, d_ok,
                          stride_slot, stride_head, PAGE)  # [N, D]
        v = _load_kv_tile(v_cache_ptr, table_row, key_pos, key_ok, kv_head, offs_d, d_ok,
                          stride_slot, stride_head, PAGE)
        m_i, l_i, acc = _softmax_step(q, k, v, key_ok[None, :], m_i, l_i, acc, scale,
                                      DOT_PRECISION)

    if SINGLE_SPLIT:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = (decode * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [G]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=g_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=g_ok)
        tl.store(part_sum_ptr + part, l_i, mask=g_ok)


@triton.jit(do_not_specialize=["window", "num_splits"])
def _decode_combine_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, decode_ids_ptr, query_start_ptr,
    context_len_ptr, window, num_splits, stride_ot,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """The output of one (decode, query head) from the partials of its non-empty splits (the
    empty ones wrote nothing: their slots hold whatever an earlier step left)."""
    decode, head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(decode_ids_ptr + decode)
    row = tl.load(query_start_ptr + seq)
    context_len = tl.load(context_len_ptr + seq)
    first = _first_decode_key(context_len, window, HAS_WINDOW)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < _decode_num_nonempty_splits(first, context_len, num_splits, BLOCK_N)  # [S]
    part = (decode * tl.num_programs(1) + head) * num_splits + offs_s  # [S]
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))  # [S]
    l_i = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)  # [S, D]
    # Split 0 always holds the first visible key, so the max is finite; skipped splits weigh 0.
    weight = tl.exp(m - tl.max(m, 0))  # [S]
    out = tl.sum(weight[:, None] * o, 0) / tl.sum(weight * l_i, 0)  # [D]
    tl.store(out_ptr + row * stride_ot + head * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["window", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, prefill_ids_ptr, query_start_ptr,
    query_len_ptr, context_len_ptr, scale, window,
    stride_qt, stride_qh, stride_slot, stride_head, stride_bt, stride_ot,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    prefill, q_tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(prefill_ids_ptr + prefill)
    query_len = tl.load(query_len_ptr + seq)
    if q_tile * BLOCK_M >= query_len:
        return
    row0 = tl.load(query_start_ptr + seq)
    context_len = tl.load(context_len_ptr + seq)
    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] offsets into the chunk
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok, d_ok = offs_m < query_len, offs_d < HEAD_DIM
    q_pos = context_len - query_len + offs_m  # [M]
    q = tl.load(q_ptr + (row0 + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    kv_head = head // GROUP
    end = tl.minimum(context_len - query_len + (q_tile + 1) * BLOCK_M, context_len)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(context_len - query_len + q_tile * BLOCK_M - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    for tile in range(start, end, BLOCK_N):
        key_pos = tile + tl.arange(0, BLOCK_N)  # [N]
        key_ok = key_pos < end
        k = _load_kv_tile(k_cache_ptr, table_row, key_pos, key_ok, kv_head, offs_d, d_ok,
                          stride_slot, stride_head, PAGE)  # [N, D]
        v = _load_kv_tile(v_cache_ptr, table_row, key_pos, key_ok, kv_head, offs_d, d_ok,
                          stride_slot, stride_head, PAGE)
        visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])  # [M, N]
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale, DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded rows saw nothing
    tl.store(out_ptr + (row0 + offs_m)[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _pow2(n: int, least: int = 16) -> int:
    """A tile dimension: a power of two (``tl.arange``), at least ``least``. ``tl.dot`` on NVIDIA
    (Triton 3.6 and later, `min_dot_size`) wants K of at least 16 for 16-bit inputs and 8 for
    fp32, and M and N of at least 1 (the tensor cores pad M to 16 themselves)."""
    return max(least, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> Optional[str]:
    """fp32 stays exact (TF32 would break parity with the PyTorch reference); 16-bit inputs take
    the target's default."""
    return "ieee" if dtype == torch.float32 else None


def num_decode_splits(num_decodes: int, num_kv_heads: int, max_keys: int,
                      min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """How many splits a decode launch has: enough programs to fill the device, but no more than
    give the longest context (``max_keys``) ``min_split_keys`` keys a split. Each sequence then
    cuts its own keys into that many runs of whole tiles (`decode_split_range`): a shorter
    context leaves the last splits empty rather than making them shorter than a tile."""
    wanted = max(1, -(-TARGET_PROGRAMS // max(1, num_decodes * num_kv_heads)))
    return max(1, min(wanted, -(-max_keys // min_split_keys)))


def _check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1, "last dimension must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share a layout"


class KernelLaunch(NamedTuple):
    """One kernel launch, as built for a step: ``kernel[grid](*args, **constexprs)``. Built apart
    from the launch so that `scripts/check_gpu_kernels.py` compiles exactly what a step runs
    for a GPU on a machine without one (``kernel.warmup``)."""

    kernel: Any
    grid: Tuple[int, ...]
    args: Tuple[Any, ...]
    constexprs: Dict[str, Any]  # and launch options (num_warps)

    def launch(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: BlockTableMetadata, scale: float, out: torch.Tensor,
                 min_split_keys: int = MIN_SPLIT_KEYS) -> None:
    """Attention of the decodes' queries (rows of ``query`` ``[T, H, D]``) over the paged cache
    ``[num_slots, Hkv, D]``, written into their rows of ``out`` ``[T, H * D]``."""
    for launch in decode_launches(query, k_cache, v_cache, meta, scale, out, min_split_keys):
        launch.launch()


def decode_launches(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: BlockTableMetadata, scale: float, out: torch.Tensor,
                    min_split_keys: int = MIN_SPLIT_KEYS) -> List[KernelLaunch]:
    """`paged_decode`'s launches: the split kernel, then the combine kernel if it split."""
    _check_layout(query, k_cache, v_cache)
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_splits = num_decode_splits(meta.num_decodes, num_kv_heads, meta.max_decode_keys,
                                   min_split_keys)
    head_dim_pad = _pow2(head_dim)
    part_shape = (meta.num_decodes, num_heads, num_splits) if num_splits > 1 else (0,)
    part_out = query.new_empty(*part_shape, head_dim_pad, dtype=torch.float32)  # [Bd, H, S, D]
    part_max = query.new_empty(part_shape, dtype=torch.float32)  # [Bd, H, S]
    part_sum = query.new_empty(part_shape, dtype=torch.float32)  # [Bd, H, S]
    window = meta.sliding_window
    launches = [KernelLaunch(_decode_split_kernel, (meta.num_decodes, num_kv_heads, num_splits), (
        query, k_cache, v_cache, meta.block_table, meta.decode_ids, meta.query_start,
        meta.context_len, out, part_out, part_max, part_sum,
        scale, window or 0, num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        meta.block_table.stride(0), out.stride(0)), dict(
        GROUP=group, GROUP_PAD=_pow2(group, least=1), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        PAGE=meta.block_size, BLOCK_N=DECODE_BLOCK_N, HAS_WINDOW=window is not None,
        SINGLE_SPLIT=num_splits == 1, DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=DECODE_NUM_WARPS_FP32 if query.dtype == torch.float32 else DECODE_NUM_WARPS))]
    if num_splits > 1:
        launches.append(KernelLaunch(_decode_combine_kernel, (meta.num_decodes, num_heads), (
            part_out, part_max, part_sum, out, meta.decode_ids, meta.query_start,
            meta.context_len, window or 0, num_splits, out.stride(0)), dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_N=DECODE_BLOCK_N,
            HAS_WINDOW=window is not None)))
    return launches


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: BlockTableMetadata, prefill_ids: torch.Tensor, scale: float,
                  out: torch.Tensor) -> None:
    """Attention of the chunks of ``prefill_ids`` ``[Bp]`` over their cached and new keys, written
    into their rows of ``out`` ``[T, H * D]``."""
    prefill_launch(query, k_cache, v_cache, meta, prefill_ids, scale, out).launch()


def prefill_launch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: BlockTableMetadata, prefill_ids: torch.Tensor, scale: float,
                   out: torch.Tensor) -> KernelLaunch:
    """`paged_prefill`'s launch."""
    _check_layout(query, k_cache, v_cache)
    _, num_heads, head_dim = query.shape
    most = PREFILL_BLOCK_M_FP32 if query.dtype == torch.float32 else PREFILL_BLOCK_M
    block_m = min(most, _pow2(meta.max_query_len))
    window = meta.sliding_window
    grid = (prefill_ids.shape[0], -(-meta.max_query_len // block_m), num_heads)
    return KernelLaunch(_prefill_kernel, grid, (
        query, k_cache, v_cache, out, meta.block_table, prefill_ids, meta.query_start,
        meta.query_len, meta.context_len, scale, window or 0,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1),
        meta.block_table.stride(0), out.stride(0)), dict(
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2(head_dim),
        PAGE=meta.block_size, BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N,
        HAS_WINDOW=window is not None, DOT_PRECISION=_dot_precision(query.dtype)))
