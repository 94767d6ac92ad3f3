"""The LM head and the greedy ids inside the decode graph (`workers.cuda_graphs`), and what the
sampler and the runner make of its static outputs (`workers.step_logits`).

As in tests/workers/test_cuda_graphs.py, ``DecodeGraphs(capture=False)`` runs the forward a graph
captures eagerly on CPU, under Triton's interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the triton kernels are decorated

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytest.importorskip("triton")

from kv.attention.backend import make_attention_backend  # noqa: E402
from kv.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from parallel.tp_group import TPGroup  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.cuda_graphs import DecodeGraphs  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.loader import load_weights  # noqa: E402
from workers.model_config import load_model_config  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.models.llama import LlamaForCausalLM  # noqa: E402
from workers.sampler import first_max  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.step_plan import KnownSeqStep, NewSeqStep, StepPlan  # noqa: E402

CPU = torch.device("cpu")
GREEDY = dict(temperature=0.0)


def engine(model_dir, graphs: bool, **overrides):
    """A triton-backend engine; ``graphs``: its decode steps through the eager stand-in."""
    made = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=96,
                                  attention_backend="triton", dtype="float32", **overrides))
    if graphs:
        ranks_runner = made.rank.runner
        ranks_runner.graphs = DecodeGraphs(ranks_runner.model, ranks_runner.kv_cache,
                                           ranks_runner.tables, max_model_len=256, max_batch=8,
                                           capture=False)
    return made


class _LogitOps(TorchDispatchMode):
    """Records the ops outside ``DecodeGraphs._forward`` that compute logits (a tensor with a
    vocabulary-sized last dim; views of one compute nothing) or a maximum over them (``max``,
    ``argmax``)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.inside, self.seen = vocab, False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        shaped = isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == self.vocab
        if not (self.inside or func.is_view) and (shaped or name in ("max", "argmax")):
            self.seen.append(name)
        return out


@contextlib.contextmanager
def recording_logit_ops(monkeypatch, vocab: int):
    mode = _LogitOps(vocab)
    forward = DecodeGraphs._forward

    def marked(graphs, size):
        mode.inside = True
        try:
            return forward(graphs, size)
        finally:
            mode.inside = False

    monkeypatch.setattr(DecodeGraphs, "_forward", marked)
    with mode:
        yield mode


def run(engine, requests):
    """Each request's (token ids, rounded logprobs), every request submitted at once."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = (out.output_token_ids,
                                     [round(t.logprob, 4) for t in out.logprobs])
    return final


@pytest.mark.parametrize("overlap", [False, True])
def test_an_all_greedy_graph_step_computes_logits_and_ids_in_the_graph_alone(
        tiny_llama, monkeypatch, overlap):
    """Outside the static forward a greedy decode step through the graph computes no logits
    and no maximum: the sampler takes the graph's ids. A prefill step (eager) does both, which
    is what the recorder would see of a step computing them outside."""
    vocab = load_model_config(tiny_llama).vocab_size
    with engine(tiny_llama, graphs=True, async_scheduling=overlap) as llm:
        graphs = llm.rank.runner.graphs
        for rid, prompt in enumerate([[5, 17, 40, 2], [100, 3]]):
            llm.add_request(prompt, SamplingParams(max_tokens=6, **GREEDY), request_id=str(rid))
        seen_by_kind = {"graph": [], "eager": []}
        while llm.has_unfinished():
            runs = graphs.num_runs
            with recording_logit_ops(monkeypatch, vocab) as ops:
                llm.step()
            seen_by_kind["graph" if graphs.num_runs > runs else "eager"].append(ops.seen)
    assert len(seen_by_kind["graph"]) >= 4 and seen_by_kind["eager"]
    assert all(seen == [] for seen in seen_by_kind["graph"]), seen_by_kind["graph"]
    assert "max" in seen_by_kind["eager"][0] and len(seen_by_kind["eager"][0]) >= 2


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_graph_steps_sample_the_graphs_logits_as_eager_steps_do(tiny_llama, overlap):
    """Seeded draws and logprobs beside greedy rows: the sampler reads the graph's logits (no
    graph ids) and gets the tokens and logprobs of the same engine without graphs."""
    seeded = dict(temperature=0.9, top_p=0.9)
    requests = {
        "greedy": ([5, 17, 40, 2], SamplingParams(max_tokens=7, **GREEDY)),
        "seeded": ([40, 41, 42], SamplingParams(max_tokens=7, seed=7, **seeded)),
        "logprobs": ([70, 71], SamplingParams(max_tokens=5, logprobs=2, **GREEDY)),
    }
    results, num_runs = [], []
    for graphs in (False, True):
        with engine(tiny_llama, graphs, async_scheduling=overlap) as llm:
            results.append(run(llm, requests))
            num_runs.append(0 if not graphs else llm.rank.runner.graphs.num_runs)
    assert num_runs[1] >= 4
    eager, graphed = results
    assert {rid: ids for rid, (ids, _) in graphed.items()} == \
        {rid: ids for rid, (ids, _) in eager.items()}
    assert graphed["logprobs"][1] == pytest.approx(eager["logprobs"][1], abs=1e-3)
    assert len(graphed["logprobs"][1]) == 5


def runner(model_dir, graphs: bool) -> ModelRunner:
    """A triton-backend runner of one rank (dense weights: the LM head's GEMM writes the static
    logits itself); ``graphs``: its decode steps through the eager stand-in."""
    config = load_model_config(model_dir)
    model = LlamaForCausalLM(config, TPGroup(0, 1, CPU), torch.float32, 64,
                             make_attention_backend("triton"))
    load_weights(model, model_dir)
    kv_cache = KVCache(KVCacheSpec(config.num_layers, 8, 4, config.num_kv_heads, config.head_dim,
                                   torch.float32), CPU, with_scratch_block=True)
    made = ModelRunner(model, kv_cache, CPU, max_model_len=64, max_graph_batch=4)
    if graphs:
        made.graphs = DecodeGraphs(model, kv_cache, made.tables, 64, max_batch=4, capture=False)
    return made


def test_last_sampled_outlives_a_replay_in_which_not_every_row_samples(tiny_llama, caplog):
    """A step's greedy ids become ``last_sampled`` as the graph's view; a later replay whose
    rows do not all sample overwrites that view, and the runner keeps the ids it names."""
    with caplog.at_level("INFO", logger="workers.cuda_graphs"):
        graphed = runner(tiny_llama, graphs=True)
    assert "static logits of 4 x 509 float32" in caplog.text  # its size, logged once
    graphed.execute(StepPlan(seqs=(NewSeqStep(0, (5, 17, 40), 0, (0, 1), True),
                                   NewSeqStep(1, (100, 3), 0, (2, 3), True))))
    step = graphed.execute(StepPlan(seqs=(KnownSeqStep(0, (9,), (), True),
                                          KnownSeqStep(1, (8,), (), True))))
    assert step.greedy_ids is not None and torch.equal(step.greedy_ids, first_max(step.logits))
    graphed.last_sampled = step.greedy_ids  # what the sampler hands on for an all-greedy step
    sampled = step.greedy_ids.clone()
    # Neither row samples (the tokens of prefill chunks): the sampler leaves last_sampled be.
    none = graphed.execute(StepPlan(seqs=(KnownSeqStep(0, (250,), (), False),
                                          KnownSeqStep(1, (251,), (), False))))
    assert none.logits.shape[0] == 0 and none.greedy_ids is None
    assert not torch.equal(step.greedy_ids, sampled)  # the replay rewrote the graph's ids
    assert torch.equal(graphed.last_sampled, sampled)
    # Placeholders name its rows: the next step runs the ids sampled two steps before.
    placeholders = graphed.execute(StepPlan(seqs=(KnownSeqStep(0, (-1,), (), True),
                                                  KnownSeqStep(1, (-2,), (), True))))
    eager = runner(tiny_llama, graphs=False)
    for plan in (StepPlan(seqs=(NewSeqStep(0, (5, 17, 40, 9, 250), 0, (0, 1), False),
                                NewSeqStep(1, (100, 3, 8, 251), 0, (2, 3), False))),
                 StepPlan(seqs=(KnownSeqStep(0, (int(sampled[0]),), (), True),
                                KnownSeqStep(1, (int(sampled[1]),), (), True)))):
        expected = eager.execute(plan)
    assert torch.equal(placeholders.greedy_ids, first_max(expected.logits))
    assert torch.allclose(placeholders.logits, expected.logits, atol=1e-5)
