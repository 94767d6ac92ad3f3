"""``--gpu-memory-utilization``: the sizing arithmetic, the profile step (run through the real
model on CPU and checked against ``transformers``), and the refusals. The memory readings
themselves need CUDA: ``scripts/gpu_check.py`` runs an engine sized this way on a GPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the triton kernels are decorated

import importlib.util  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from cluster.cli.main import build_parser  # noqa: E402
from cluster.options import engine_config  # noqa: E402
from cluster.serve_config import serve_config_from_args  # noqa: E402
from tiny_models import hf_greedy  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine_sizing import fit_context_to_pool  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.memory_profile import (GIB, SAMPLER_BYTES_PER_LOGIT, MemoryProfile,  # noqa: E402
                                    profile_plan, run_profile_step, sampler_reserve)
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.step_plan import NewSeqStep  # noqa: E402

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def test_the_pool_takes_what_the_fraction_leaves_after_use_step_and_sampler():
    profile = MemoryProfile(total=80 * GIB, used=20 * GIB, peak_step=3 * GIB,
                            sampler_reserve=1 * GIB)
    # 0.9 x 80 = 72 GiB, less 20 in use, 3 for the step, 1 for sampling: 48 GiB of 2 MiB
    # blocks, one of them kept for the scratch block
    assert profile.num_blocks(0.9, 2 << 20) == 48 * 512 - 1
    for room, pool in ((2 << 20, 0), (4 << 20, 1)):  # 0.5 x 80 = 40 GiB, 4 needed: room left
        tight = MemoryProfile(total=80 * GIB, used=36 * GIB - room, peak_step=3 * GIB,
                              sampler_reserve=1 * GIB)
        assert tight.num_blocks(0.5, 2 << 20) == pool  # one block of room: the scratch block
    assert profile.num_blocks(0.25, 2 << 20) < 0
    message = profile.no_room(0.3)
    for figure in ("--gpu-memory-utilization 0.3", "80.00 GiB", "20.00 GiB are in use",
                   "step needs 3.00 GiB", "sampling 1.00 GiB"):
        assert figure in message


@pytest.mark.parametrize("batched, seqs, model_len", [(2048, 128, 4096), (64, 128, 4096),
                                                      (2048, 4, 300), (5, 1, 8), (2048, 1, 512)])
def test_the_profile_step_is_the_largest_the_scheduler_may_send(batched, seqs, model_len):
    plan = profile_plan(batched, seqs, model_len, block_size=16)
    lengths = [len(s.token_ids) for s in plan.seqs]
    assert len(lengths) == min(seqs, batched)
    assert max(lengths) <= model_len and lengths[1:] == [1] * (len(lengths) - 1)
    assert sum(lengths) == min(batched, model_len + len(lengths) - 1)
    blocks = [b for s in plan.seqs for b in s.block_ids]
    assert blocks == list(range(len(blocks)))  # each sequence its own blocks
    for step, length in zip(plan.seqs, lengths):
        assert isinstance(step, NewSeqStep) and step.needs_logits and step.num_computed == 0
        assert len(step.block_ids) == math.ceil(length / 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_profile_step_runs_the_real_model_into_a_cache_of_its_own(tiny_llama, backend):
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                          attention_backend=backend, dtype="float32")
    with LLM(config) as llm:
        rank = llm.engine.rank
        pool = rank.runner.kv_cache.data.clone()
        plan = profile_plan(40, 5, llm.engine.max_model_len, block_size=4)
        logits = run_profile_step(rank.runner.model, rank.runner.kv_cache.spec,
                                  torch.device("cpu"), plan, llm.engine.max_model_len)
        assert torch.equal(rank.runner.kv_cache.data, pool)  # the engine's pool untouched
        outputs = llm.generate([[5, 17, 40, 2]], SamplingParams(max_tokens=5, temperature=0.0))
    assert logits.shape == (5, rank.config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.zeros(1, 36, dtype=torch.long)).logits[0, -1]
        one = hf(torch.zeros(1, 1, dtype=torch.long)).logits[0, -1]
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)  # the 36-token prefill
    torch.testing.assert_close(logits[1:], one.expand(4, -1), atol=1e-4, rtol=1e-4)
    assert outputs[0].output_token_ids == hf_greedy(tiny_llama, [[5, 17, 40, 2]], 5)[0]


def test_refused_on_cpu_by_name_before_any_rank_starts(tiny_llama):
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.8 sizes the KV pool from "
                                         r"a CUDA device.*runs on the CPU.*--kv-cache-gb"):
        LLM(EngineConfig(model=str(tiny_llama), device="cpu", gpu_memory_utilization=0.8))


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.2])
def test_a_fraction_outside_zero_to_one_is_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        EngineConfig(model=str(tiny_llama), gpu_memory_utilization=bad)


def test_the_option_reaches_the_engine_config():
    args = build_parser().parse_args(["generate", "--gpu-memory-utilization", "0.85",
                                      "--prompts-file", "p.jsonl"])
    assert engine_config(args).gpu_memory_utilization == 0.85
    args = build_parser().parse_args(["generate", "--prompts-file", "p.jsonl"])
    assert engine_config(args).gpu_memory_utilization is None
    # a Serve config file's args (and so Helm's serve.extraArgs)
    engine = serve_config_from_args({"gpu_memory_utilization": 0.9}, {}).engine
    assert engine.gpu_memory_utilization == 0.9


def test_a_context_that_does_not_fit_the_sized_pool_names_the_fraction(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), block_size=16, max_model_len=4096,
                          gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"--max-model-len 4096 does not fit: the KV pool "
                                         r"\(--gpu-memory-utilization 0.5: 100 blocks.*raise "
                                         r"--gpu-memory-utilization"):
        fit_context_to_pool(config, 4096, 100)
    capped = EngineConfig(model=str(tiny_llama), block_size=16, max_model_len=4096,
                          gpu_memory_utilization=0.5, num_kv_blocks=100)
    with pytest.raises(ValueError, match=r"\(--kv-blocks 100: 100 blocks.*set --kv-blocks to "
                                         r"at least 256"):
        fit_context_to_pool(capped, 4096, 100)  # the cap held it, not the fraction


def _agree(rank, world, init_method, values, results):
    from parallel.tp_group import TPGroupConfig, init_tp_group
    from workers.memory_profile import agree_min

    tp = init_tp_group(TPGroupConfig(rank, world, init_method), torch.device("cpu"))
    results.put((rank, [agree_min(v[rank], tp.startup_group) for v in values]))
    tp.destroy()


@pytest.mark.multiproc
def test_every_rank_of_a_group_takes_the_smallest_pool():
    import torch.multiprocessing as mp

    from workers.multiproc import free_tcp_init_method

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    values = [(1000, 700), (5, 9), (0, 12)]  # a rank with no room makes every rank refuse
    init = free_tcp_init_method()
    procs = [ctx.Process(target=_agree, args=(r, 2, init, values, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert rows == [(0, [700, 5, 0]), (1, [700, 5, 0])]


def test_the_sampler_reserve_is_the_sampled_rows_and_nothing_on_ranks_without_logits():
    """TP ranks 1..N-1 get no logits from the profile step (they do not sample): no reserve,
    where reading the shape of their None would fail the rank's start."""
    assert sampler_reserve(torch.empty(5, 300)) == 5 * 300 * SAMPLER_BYTES_PER_LOGIT
    assert sampler_reserve(None) == 0
