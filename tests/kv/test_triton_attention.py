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

    def run_kernels(self, min_split_keys):
        """The Triton kernels alone, with ``min_split_keys`` to force many decode splits."""
        meta = build_block_table_metadata(self.seqs, self.block_size, CPU, [self.window])[0]
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        k_cache[meta.slot_mapping], v_cache[meta.slot_mapping] = self.new_k, self.new_v
        out = torch.full((self.query.shape[0], self.query.shape[1] * self.head_dim),
                         float("nan"), dtype=self.query.dtype)
        scale = self.head_dim ** -0.5
        if meta.num_decodes:
            triton_attention.paged_decode(self.query, k_cache, v_cache, meta, scale, out,
                                          min_split_keys=min_split_keys)
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
