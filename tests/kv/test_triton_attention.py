"""The Triton paged-attention kernels equal the PyTorch reference backend (and dense causal
attention), run on CPU under Triton's interpreter.

Every slot the attention must not read holds NaN: free slots, and the positions of a sequence that
left its sliding window (the scheduler frees their blocks, and anything may be written there). A
kernel that read one would return NaN. bfloat16 is not checked here: the interpreter multiplies
the raw bits of bfloat16 ``tl.dot`` operands (triton-lang/triton#11584); a GPU check covers it.
"""

import os

# Before triton's @jit decorates the kernels (kv.attention.triton_paged); TRITON_INTERPRET=0 runs them
# on a GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from attention_reference import dense_reference  # noqa: E402
from kv.attention import triton_paged as triton_attention  # noqa: E402
from kv.attention.backend import TorchAttentionBackend, TritonAttentionBackend  # noqa: E402
from kv.attention.metadata import SeqSlice, first_key_position  # noqa: E402
from kv.attention.block_table_metadata import build_block_table_metadata  # noqa: E402

CPU = torch.device("cpu")


class Step:
    """A step of ``shapes`` ((cached, new) per sequence) over a pool of scattered blocks whose
    unreadable slots hold NaN; ``new_kv`` are the new tokens' K/V, not yet in the cache."""

    def __init__(self, shapes, heads, kv_heads, head_dim, block_size, window, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
        num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 3
        self.k_cache = torch.full((num_blocks * block_size, kv_heads, head_dim), float("nan"),
                                  dtype=dtype)
        self.v_cache = self.k_cache.clone()
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        self.seqs, self.k, self.v, queries = [], [], [], []
        for num_computed, query_len in shapes:
            ctx = num_computed + query_len
            blocks = [free.pop() for _ in range(-(-ctx // block_size))]
            k, v = rand(ctx, kv_heads, head_dim), rand(ctx, kv_heads, head_dim)
            first = first_key_position(num_computed, window)  # before it: never read
            slots = [blocks[p // block_size] * block_size + p % block_size
                     for p in range(first, num_computed)]
            self.k_cache[slots], self.v_cache[slots] = k[first:num_computed], v[first:num_computed]
            self.seqs.append(SeqSlice(query_len, num_computed, blocks))
            self.k.append(k)
            self.v.append(v)
            queries.append(rand(query_len, heads, head_dim))
        self.query = torch.cat(queries)  # [T, H, D]
        self.new_k = torch.cat([k[s.num_computed:] for k, s in zip(self.k, self.seqs)])
        self.new_v = torch.cat([v[s.num_computed:] for v, s in zip(self.v, self.seqs)])
        self.block_size, self.window, self.head_dim = block_size, window, head_dim

    def run(self, backend):
        meta = backend.build_metadata(self.seqs, self.block_size, CPU, [self.window])[0]
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        return backend.forward(self.query, self.new_k, self.new_v, k_cache, v_cache, meta,
                               self.head_dim ** -0.5)

    def run_kernels(self, min_split_keys, max_decode_keys=None):
        """The Triton kernels alone, with ``min_split_keys`` to force many decode splits, and
        ``max_decode_keys`` to size the decode launch for longer contexts than the step's (as a
        CUDA graph sized for ``max_model_len`` does). The decode partials start as NaN: a split
        the combine reads must have written its slot."""
        meta = build_block_table_metadata(self.seqs, self.block_size, CPU, [self.window])[0]
        if max_decode_keys is not None:
            meta = dataclasses.replace(meta, max_decode_keys=max_decode_keys)
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = self.new_k, self.new_v
        out = torch.full((self.query.shape[0], self.query.shape[1] * self.head_dim),
                         float("nan"), dtype=self.query.dtype)
        scale = self.head_dim ** -0.5
        if meta.num_decodes:
            launches = triton_attention.decode_launches(self.query, k_cache, v_cache, meta,
                                                        scale, out, min_split_keys)
            for partial in launches[0].args[8:11]:  # part_out, part_max, part_sum
                partial.fill_(float("nan"))
            for launch in launches:
                launch.launch()
        if meta.prefill_ids.shape[0]:
            triton_attention.paged_prefill(self.query, k_cache, v_cache, meta,
                                           meta.prefill_ids, scale, out)
        return out

    def dense(self):
        queries = self.query.split([s.query_len for s in self.seqs])
        return torch.cat([dense_reference(q, k, v, s.num_computed, self.window)
                          for q, k, v, s in zip(queries, self.k, self.v, self.seqs)])


def check(step, out, atol=2e-5):
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), step.dense(), rtol=1e-4, atol=atol)
    torch.testing.assert_close(out, step.run(TorchAttentionBackend()), rtol=1e-4, atol=atol)


# (KV heads, query heads): MHA, GQA 2 and 4, MQA.
HEADS = [(2, 2), (2, 4), (1, 4), (2, 8), (1, 1)]
seq_shape = st.tuples(st.integers(0, 90), st.integers(1, 24))  # (cached, new)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(seq_shape, min_size=1, max_size=5),
       heads=st.sampled_from(HEADS), head_dim=st.sampled_from([16, 64, 80, 128]),
       block_size=st.sampled_from([1, 4, 16, 64]),
       window=st.one_of(st.none(), st.integers(1, 40)),
       min_split_keys=st.sampled_from([16, 32, 256]), seed=st.integers(0, 2 ** 16))
def test_kernels_match_reference(shapes, heads, head_dim, block_size, window, min_split_keys,
                                 seed):
    kv_heads, num_heads = heads
    step = Step(shapes, num_heads, kv_heads, head_dim, block_size, window, torch.float32, seed)
    check(step, step.run_kernels(min_split_keys))


@pytest.mark.parametrize("head_dim,heads,window", [
    (64, (2, 8), None), (128, (1, 4), 19), (128, (4, 4), None), (64, (2, 4), 7)])
def test_backend_mixed_step(head_dim, heads, window):
    """Decodes past several blocks, fresh and cached-prefix prefills, a one-token prompt."""
    kv_heads, num_heads = heads
    shapes = [(37, 1), (0, 21), (18, 9), (70, 1), (0, 1), (33, 16)]
    step = Step(shapes, num_heads, kv_heads, head_dim, 8, window, torch.float32, seed=1)
    check(step, step.run(TritonAttentionBackend()))


@pytest.mark.parametrize("window", [None, 12])
def test_sdpa_for_fresh_prefills(window):
    """The CUDA path for prefills with nothing cached (forced on here): SDPA on the new K/V,
    the paged kernel for the rest; a fresh prompt longer than the window takes the kernel."""
    shapes = [(0, 9), (0, 30), (12, 5), (20, 1)]
    step = Step(shapes, 4, 2, 64, 4, window, torch.float32, seed=2)
    meta = build_block_table_metadata(step.seqs, 4, CPU, [window])[0]
    assert meta.fresh_prefills == (((0, 9), (9, 39)) if window is None else ((0, 9),))
    check(step, step.run(TritonAttentionBackend(sdpa_fresh_prefills=True)))


def test_float16():
    step = Step([(40, 1), (9, 12), (0, 17)], 8, 2, 64, 16, None, torch.float16, seed=3)
    out = step.run(TritonAttentionBackend())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), step.dense(), rtol=1e-2, atol=2e-3)


def test_decode_splits_fill_the_device_but_stay_long():
    assert triton_attention.num_decode_splits(1, 8, 32768) == 64  # 512 programs
    assert triton_attention.num_decode_splits(1, 8, 300) == 2  # no split under 256 keys
    assert triton_attention.num_decode_splits(128, 8, 32768) == 1  # already 1024 programs


def test_metadata_per_window():
    seqs = [SeqSlice(1, 30, [3, 1, 4, 1, 5, 9, 2, 6]), SeqSlice(20, 0, [7, 8, 0, 2, 5]),
            SeqSlice(5, 0, [6, 4])]
    full, windowed = build_block_table_metadata(seqs, 4, CPU, [None, 8])
    assert full.decode_ids.tolist() == [0] and full.prefill_ids.tolist() == [1, 2]
    assert full.query_start.tolist() == [0, 1, 21] and full.context_len.tolist() == [31, 20, 5]
    assert full.block_table.tolist()[1] == [7, 8, 0, 2, 5, 0, 0, 0]
    assert full.max_decode_keys == 31 and windowed.max_decode_keys == 8
    assert full.fresh_prefills == ((1, 21), (21, 26)) and windowed.fresh_prefills == ((21, 26),)
    assert windowed.cached_prefill_ids.tolist() == [1]
    assert windowed.block_table is full.block_table


def decodes(contexts):
    """(cached, new) shapes of one decode per context length."""
    return [(context - 1, 1) for context in contexts]


def num_splits_of(step, max_decode_keys, min_split_keys=triton_attention.MIN_SPLIT_KEYS):
    return triton_attention.num_decode_splits(len(step.seqs), step.k_cache.shape[1],
                                              max_decode_keys, min_split_keys)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decodes_far_below_max_model_len(group):
    """A launch sized for 8,192 keys (32 splits) over contexts of 1..300: each sequence spreads
    its own keys over the splits, the rest exit, and the result is the reference's."""
    contexts = [1, 2, 63, 64, 65, 129, 300]
    step = Step(decodes(contexts), 2 * group, 2, 64, 16, None, torch.float32, seed=group)
    assert num_splits_of(step, 8192) == 32
    check(step, step.run_kernels(triton_attention.MIN_SPLIT_KEYS, max_decode_keys=8192))


@pytest.mark.parametrize("window", [None, 100])
def test_decode_split_edges(window):
    """Contexts at and around multiples of the tile (64) and of a split's share (32 splits of
    one tile: 2,048 keys), and a context of one key; with a window the edges move to ``first``."""
    contexts = [1, 64, 65, 127, 128, 2047, 2048, 2049]
    step = Step(decodes(contexts), 4, 1, 16, 16, window, torch.float32, seed=7)
    assert num_splits_of(step, 8192) == 32
    check(step, step.run_kernels(triton_attention.MIN_SPLIT_KEYS, max_decode_keys=8192))


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(contexts=st.lists(st.integers(1, 300), min_size=1, max_size=4),
       group=st.sampled_from([1, 2, 4, 8]), kv_heads=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([16, 64]), block_size=st.sampled_from([1, 16]),
       window=st.one_of(st.none(), st.integers(1, 200)),
       max_decode_keys=st.sampled_from([300, 2048, 8192]), seed=st.integers(0, 2 ** 16))
def test_decodes_sized_for_longer_contexts_match_reference(contexts, group, kv_heads, head_dim,
                                                           block_size, window, max_decode_keys,
                                                           seed):
    step = Step(decodes(contexts), group * kv_heads, kv_heads, head_dim, block_size, window,
                torch.float32, seed)
    check(step, step.run_kernels(triton_attention.MIN_SPLIT_KEYS, max_decode_keys))


def test_a_short_context_uses_a_tile_per_split_under_a_long_launch():
    split_range = triton_attention.decode_split_range
    ranges = [split_range(0, 300, s, 8, 64) for s in range(8)]
    assert ranges[:5] == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    assert all(start >= end for start, end in ranges[5:])
    assert split_range(0, 1, 0, 32, 64) == (0, 1)  # a context of one key: split 0 alone
    assert split_range(0, 1, 1, 32, 64)[0] >= 1
    assert split_range(40, 300, 0, 8, 64) == (40, 104)  # a window: tiles from the first key
    assert triton_attention.decode_num_nonempty_splits(0, 300, 8, 64) == 5
    assert triton_attention.decode_num_nonempty_splits(0, 8192, 8, 64) == 8


@settings(max_examples=300, deadline=None, derandomize=True)
@given(first=st.integers(0, 5000), num_keys=st.integers(1, 20000),
       num_splits=st.integers(1, 600), block_n=st.sampled_from([16, 32, 64]))
def test_split_ranges_tile_each_context_and_are_bounded_by_it(first, num_keys, num_splits,
                                                              block_n):
    """The splits of a context cover its keys once, in order, in whole tiles from its first key;
    a program visits at most ceil(tiles / splits) tiles of its own context (never more because
    the launch was sized for longer ones); the empty splits are the last ones."""
    context_len = first + num_keys
    num_tiles = -(-num_keys // block_n)
    ranges = [triton_attention.decode_split_range(first, context_len, s, num_splits, block_n)
              for s in range(num_splits)]
    nonempty = [(start, end) for start, end in ranges if start < end]
    num_nonempty = triton_attention.decode_num_nonempty_splits(first, context_len, num_splits,
                                                               block_n)
    assert ranges[:num_nonempty] == nonempty
    covered = [k for start, end in nonempty for k in (start, end)]
    assert covered[0] == first and covered[-1] == context_len
    assert covered[1:-1:2] == covered[2:-1:2]  # each split starts where the last one ended
    for start, end in nonempty:
        assert (start - first) % block_n == 0
        assert -(-(end - start) // block_n) <= -(-num_tiles // num_splits)
    assert sum(-(-(end - start) // block_n) for start, end in nonempty) == num_tiles
