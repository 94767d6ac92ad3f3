"""Sliding-window attention reads only the keys inside the window, and layers with different
windows each get their own indices.

The scheduler frees the blocks of a fully windowed model once they left the window, and another
request may then write anything into them: the attention must never read those slots. Here they
hold NaN, which would poison any output that gathered them (0 * NaN is NaN).
"""

import pytest
import torch

from kv.attention.metadata import SeqSlice, build_attention_metadata, build_layer_metadata
from kv.kv_cache import write_kv
from kv.attention.torch_paged import paged_attention

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def dense_reference(q, k, v, num_computed, window):
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    q_pos = torch.arange(q.shape[0])[:, None] + num_computed
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = (k_pos <= q_pos) if window is None else (k_pos <= q_pos) & (k_pos > q_pos - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def run(shapes, window, poison_before_window):
    """Attend ``shapes`` ((cached, new) per sequence) over scattered blocks; with
    ``poison_before_window`` the slots of blocks wholly before the window hold NaN."""
    torch.manual_seed(0)
    num_blocks = 128
    k_cache = torch.zeros(num_blocks * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks - 1, -1, -1))
    seqs, ks, vs, qs = [], [], [], []
    for num_computed, q_len in shapes:
        ctx = num_computed + q_len
        blocks = [free.pop() for _ in range(-(-ctx // BLOCK))]
        k, v = torch.randn(ctx, KV_HEADS, DIM), torch.randn(ctx, KV_HEADS, DIM)
        slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_computed)]
        k_cache[slots], v_cache[slots] = k[:num_computed], v[:num_computed]
        if poison_before_window:
            # Blocks whose every token is older than the window of the first query.
            num_gone = max(0, num_computed - window + 1) // BLOCK
            for block in blocks[:num_gone]:
                k_cache[block * BLOCK:(block + 1) * BLOCK] = float("nan")
                v_cache[block * BLOCK:(block + 1) * BLOCK] = float("nan")
        seqs.append(SeqSlice(q_len, num_computed, blocks))
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(q_len, HEADS, DIM))
    meta = build_attention_metadata(seqs, BLOCK, torch.device("cpu"), window)
    write_kv(k_cache, v_cache, torch.cat([k[s.num_computed:] for k, s in zip(ks, seqs)]),
             torch.cat([v[s.num_computed:] for v, s in zip(vs, seqs)]), meta.slot_mapping)
    out = paged_attention(torch.cat(qs), k_cache, v_cache, meta, DIM ** -0.5)
    expected = torch.cat([dense_reference(q, k, v, s.num_computed, window)
                          for q, k, v, s in zip(qs, ks, vs, seqs)])
    return out, expected


# Long decodes past the window, a chunk of a long prefill, short ones inside the window.
SHAPES = [(37, 1), (20, 1), (3, 1), (29, 6), (0, 13), (51, 1), (12, 3)]


@pytest.mark.parametrize("window", [5, 8, 9])
def test_keys_that_left_the_window_are_never_read(window, decode_path):
    out, expected = run(SHAPES, window, poison_before_window=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_layers_with_the_same_window_share_indices_and_others_get_their_own():
    seqs = [SeqSlice(1, 30, list(range(8))), SeqSlice(5, 0, list(range(8, 10)))]
    per_layer = build_layer_metadata(seqs, BLOCK, torch.device("cpu"), [None, 8, 8, None])
    assert per_layer[0] is per_layer[3] and per_layer[1] is per_layer[2]
    full, windowed = per_layer[0], per_layer[1]
    assert torch.equal(full.slot_mapping, windowed.slot_mapping)
    assert full.buckets[0].kv_slots.shape[1] == 31  # every cached key
    assert windowed.buckets[0].kv_slots.shape[1] == 8  # the window's keys only
