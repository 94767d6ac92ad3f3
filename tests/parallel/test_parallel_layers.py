"""Parallel layers across 2 real gloo processes equal their unsharded counterparts."""

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from parallel.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from parallel.tp_group import TPGroupConfig, init_tp_group
from workers.multiproc import free_tcp_init_method

pytestmark = pytest.mark.multiproc


class Source:
    """An in-memory TensorSource (the loader's safetensors source reads files the same way)."""

    def __init__(self, name, tensor):
        self.name, self.tensor, self.shape = name, tensor, tuple(tensor.shape)

    def read(self, dim=None, start=0, length=None):
        return self.tensor if dim is None else self.tensor.narrow(dim, start, length)


def load(param, tensor, shard_id=None):
    param.weight_loader(param, Source("w", tensor), shard_id)


def _check_layers(rank, world, init_method, results):
    torch.manual_seed(0)  # same full weights and inputs on every rank
    tp = init_tp_group(TPGroupConfig(rank, world, init_method), torch.device("cpu"))
    x = torch.randn(5, 8)
    w_col, b_col, w_row = torch.randn(12, 8), torch.randn(12), torch.randn(8, 12)
    col = ColumnParallelLinear(8, [12], True, tp, torch.float32)
    load(col.weight, w_col)
    load(col.bias, b_col)
    row = RowParallelLinear(12, 8, True, tp, torch.float32)
    load(row.weight, w_row)
    load(row.bias, torch.ones(8))
    mlp = row(col(x))
    expected_mlp = F.linear(F.linear(x, w_col, b_col), w_row, torch.ones(8))

    wq, wk, wv = torch.randn(8, 8), torch.randn(2, 8), torch.randn(2, 8)  # 4 heads, 1 KV head
    qkv = QKVParallelLinear(8, 2, 4, 1, False, tp, torch.float32)
    for name, w in (("q", wq), ("k", wk), ("v", wv)):
        load(qkv.weight, w, name)
    q, k, v = qkv.split(qkv(x))
    half = slice(rank * 4, rank * 4 + 4)
    qkv_ok = (torch.allclose(q, x @ wq.T[:, half]) and torch.allclose(k, x @ wk.T)
              and torch.allclose(v, x @ wv.T))  # the single KV head is replicated

    vocab = torch.randn(11, 8)  # 11 rows split 6 + 5 (+1 padding row)
    ids = torch.tensor([0, 5, 6, 10])
    emb = VocabParallelEmbedding(11, 8, tp, torch.float32)
    load(emb.weight, vocab)
    head = ParallelLMHead(11, 8, tp, torch.float32)
    head.tie_to(emb)
    logits = head(emb(ids))
    results.put((rank, torch.allclose(mlp, expected_mlp, atol=1e-5), qkv_ok,
                 torch.allclose(emb(ids), vocab[ids]),
                 None if logits is None else torch.allclose(logits, vocab[ids] @ vocab.T,
                                                            atol=1e-5),
                 tp.all_reduce_latency.count))
    tp.destroy()


def test_sharded_layers_equal_full_layers():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = free_tcp_init_method()
    procs = [ctx.Process(target=_check_layers, args=(r, 2, init, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert rows[0][1:] == (True, True, True, True, 3)  # rank 0 gets the logits
    assert rows[1][1:] == (True, True, True, None, 3)  # 1 row-parallel + 2 embedding all-reduces
