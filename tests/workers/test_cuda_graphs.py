"""Decode steps through the static, padded buffers of ``DecodeGraphs``.

On CPU the graphs cannot be captured; ``capture=False`` runs the very forward a graph would
capture (the padding rows, the scratch block, the metadata built on the device from static
buffers), under Triton's interpreter, and the engine's greedy ids must still equal
``transformers``. Capture and replay themselves run in ``scripts/gpu_check.py`` on a GPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the triton kernels are decorated

import importlib.util  # noqa: E402
import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny_models import hf_greedy  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.cuda_graphs import DecodeGraphs, graph_batch_sizes  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
PROMPTS = [[5, 17, 40, 2, 9, 33], [7] * 13, [100, 3], [250, 251, 252, 253, 254], [11, 12, 13]]
MAX_NEW = 7


def test_batch_sizes_pad_by_at_most_seven():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def engine(model_dir, **kwargs):
    return LLM(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=96,
                            attention_backend="triton", **{"dtype": "float32", **kwargs}))


@needs_triton
@pytest.mark.parametrize("overlap", [False, True])
def test_padded_static_decodes_match_transformers(tiny_llama, overlap):
    """5 sequences pad to a batch of 8, then fewer as they finish at different lengths; the
    padded rows write into the scratch block and never disturb a real block. Overlapped
    (``async_scheduling``): each step's ids are written into the graph's input buffer from the
    previous step's samples on the device."""
    reference = hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    params = [SamplingParams(max_tokens=MAX_NEW - i % 3, temperature=0.0)
              for i in range(len(PROMPTS))]
    with engine(tiny_llama, async_scheduling=overlap) as llm:
        runner = llm.engine.rank.runner
        assert runner.kv_cache.scratch_block == 96
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.tables,
                                     max_model_len=256, max_batch=8, capture=False)
        outputs = llm.generate(PROMPTS, params)
        assert runner.graphs.num_runs >= MAX_NEW - 3  # the decode steps took the static path
    for out, want, p in zip(outputs, reference, params):
        assert out.output_token_ids == want[:p.max_tokens]


@needs_triton
def test_the_block_tables_have_a_row_for_every_sequence_the_scheduler_may_run(tiny_llama):
    # A table that grows drops every decode graph (their captures read the old tensor).
    with engine(tiny_llama, max_num_seqs=100) as llm:
        tables = llm.engine.rank.runner.tables
        assert tables.table.shape[0] - 1 >= 100 and tables.version == 0


@needs_triton
def test_graphs_dropped_for_a_grown_table_take_their_memory_pool_with_them(tiny_llama):
    # Capturing into the pool of dropped graphs fails on CUDA (the pool outlives its graphs);
    # the bookkeeping runs on CPU too, where nothing is captured.
    with engine(tiny_llama, max_num_seqs=2) as llm:
        runner = llm.engine.rank.runner
        graphs = runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.tables,
                                              max_model_len=256, max_batch=8, capture=False)
        graphs._graphs[1], graphs._pool = "a captured graph", "its pool"
        for seq_id in range(1000, 1000 + 70):  # more than the 64 rows a small table starts with
            runner.tables.add(seq_id, [1])
        assert runner.tables.version > 0
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert graphs.num_runs >= 1 and graphs._graphs == {} and graphs._pool is None


@needs_triton
def test_graphs_are_off_on_cpu_and_with_enforce_eager(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="workers.cuda_graphs"), engine(tiny_llama) as llm:
        assert llm.engine.rank.runner.graphs is None
    assert "CUDA graphs run on CUDA only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.cuda_graphs"), \
            engine(tiny_llama, enforce_eager=True) as llm:
        assert llm.engine.rank.runner.graphs is None
    assert "CUDA graphs" not in caplog.text  # not asked for: nothing to say


def test_the_torch_backend_keeps_its_host_lists(tiny_llama):
    with LLM(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=32,
                          attention_backend="torch")) as llm:
        runner = llm.engine.rank.runner
        assert runner.tables is None and runner.graphs is None
        assert runner.kv_cache.scratch_block is None


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_enforce_eager_reaches_the_engine_config(command):
    from cluster.cli.main import build_parser
    from cluster.options import engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args(command + ["--enforce-eager"])).enforce_eager is True
    assert engine_config(parser.parse_args(command)).enforce_eager is False


@needs_triton
def test_capturing_every_size_at_start_writes_only_the_scratch_block(tiny_llama):
    """The start-up batches are padding rows alone: run with real K/V in the pool, they leave
    every real block as it was, and generation afterwards still equals ``transformers``."""
    reference = hf_greedy(tiny_llama, PROMPTS[:2], MAX_NEW)
    with engine(tiny_llama) as llm:
        runner = llm.engine.rank.runner
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.tables,
                                     max_model_len=256, max_batch=8, capture=False)
        data = runner.kv_cache.data
        data.normal_()
        before = data.clone()
        assert runner.capture_graphs() == [8, 4, 2, 1]
        scratch = slice(96 * 4, 97 * 4)  # block 96 of 4-token blocks: the slots after the pool
        assert torch.equal(data[:, :, :scratch.start], before[:, :, :scratch.start])
        assert not torch.equal(data[:, :, scratch], before[:, :, scratch])
        assert runner.graphs.num_runs == 0  # no step has run yet
        data.zero_()
        outputs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [out.output_token_ids for out in outputs] == reference


@needs_triton
def test_a_rank_captures_its_graphs_while_starting(tiny_llama, monkeypatch):
    # On CPU DecodeGraphs.create declines; here it returns the eager stand-in, so that the
    # start-up path itself runs: every size once, largest first, before the first request.
    captured = []
    real_capture_all = DecodeGraphs.capture_all
    monkeypatch.setattr(DecodeGraphs, "create", classmethod(
        lambda cls, model, kv, tables, max_len, max_batch:
        cls(model, kv, tables, max_len, max_batch, capture=False)))
    monkeypatch.setattr(DecodeGraphs, "capture_all",
                        lambda self: captured.append(real_capture_all(self)) or captured[-1])
    with engine(tiny_llama, max_num_seqs=6) as llm:
        assert captured == [[6, 4, 2, 1]]
        assert llm.engine.rank.runner.graphs.num_runs == 0
    with engine(tiny_llama, max_num_seqs=6, enforce_eager=True):
        assert captured == [[6, 4, 2, 1]]  # no graphs asked for: nothing captured
