"""Every class of step times its all-reduces on CPU (gloo, two real rank processes): a prefill,
an eager decode, and a decode through ``DecodeGraphs`` with ``capture=False``, which stands in
for a CUDA-graph replay here (the forward a graph captures, run eagerly under Triton's
interpreter). On CUDA the same call sites are timed by events, in the graphs too
(tests/parallel/test_graph_timing.py). The graph's LM head gathers on both ranks: rank 0 gets
the eager decode's logits and their greedy ids, rank 1 nothing."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the triton kernels are decorated

import importlib.util  # noqa: E402

import pytest  # noqa: E402

from parallel.tp_group import TPGroupConfig  # noqa: E402
from two_ranks import run_two_ranks  # noqa: E402
from workers.cuda_graphs import DecodeGraphs  # noqa: E402
from workers.rank import RankConfig, build_rank, execute_plan  # noqa: E402
from workers.sampler import first_max  # noqa: E402
from workers.step_plan import KnownSeqStep, NewSeqStep, StepPlan  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not installed")]


def _time_each_step_class(rank_index, world, init_method, model_dir, results):
    config = RankConfig(model_dir, TPGroupConfig(rank_index, world, init_method), "cpu",
                        "float32", num_kv_blocks=8, block_size=4, max_model_len=32,
                        num_threads=1, attention_backend="triton")
    rank = build_rank(config)
    runner, latency = rank.runner, rank.tp.all_reduce_latency
    stand_in = DecodeGraphs(runner.model, runner.kv_cache, runner.tables, max_model_len=32,
                            max_batch=2, capture=False)
    counts = {}
    latency.drain()
    execute_plan(rank, StepPlan(seqs=(NewSeqStep(0, (5, 6, 7), 0, (0,), True),
                                      NewSeqStep(1, (5, 6, 7), 0, (1,), True))))
    counts["prefill"] = len(latency.drain())
    eager, _ = execute_plan(rank, StepPlan(seqs=(KnownSeqStep(0, (8,), (), True),)))
    counts["eager decode"] = len(latency.drain())
    runner.graphs = stand_in  # the same token after the same prompt, in the other sequence
    graph, _ = execute_plan(rank, StepPlan(seqs=(KnownSeqStep(1, (8,), (), True),)))
    counts["graph decode"] = len(latency.drain())
    outputs = None
    if graph is not None:
        outputs = (graph.greedy_ids.tolist(), first_max(eager.logits).tolist(),
                   (graph.logits - eager.logits).abs().max().item())
    results.put((rank_index, counts, stand_in.num_runs, rank.config.num_layers, outputs,
                 eager is None))
    rank.tp.destroy()


def test_every_step_class_times_its_all_reduces(tiny_llama):
    rows = run_two_ranks(_time_each_step_class, str(tiny_llama))
    for rank_index, counts, num_graph_runs, num_layers, _, _ in rows:
        # The embedding's all-reduce and two per layer (attention and MLP outputs).
        assert counts == dict.fromkeys(["prefill", "eager decode", "graph decode"],
                                       1 + 2 * num_layers), rank_index
        assert num_graph_runs == 1
    (_, _, _, _, outputs, _), (_, _, _, _, nothing, no_logits) = rows
    graph_ids, eager_ids, max_diff = outputs
    assert graph_ids == eager_ids and max_diff < 1e-4
    assert nothing is None and no_logits
