"""Greedy parity with ``transformers`` and seeded sampling, through the engine's public API
(``LLM``, ``EngineConfig``, ``SamplingParams``), for every engine variant ``EngineConfig`` offers.

Variants are found, not assumed: ``attention_backend`` ("torch", "triton") and ``enforce_eager``
(CUDA graphs off / on) are run when ``dataclasses.fields(EngineConfig)`` has them; a value the
config refuses is reported as not available, as is a field it does not have.

* greedy: fp32 ids must equal ``transformers`` (one unpadded prompt at a time) exactly, in a
  first pass and in a second one that hits the prefix cache; one prompt is long enough to be
  prefilled in chunks and two share a prefix. bf16 runs once per backend and reports how far it
  drifts from ``transformers`` in bf16 (token mismatch rate, sequences equal, first tokens
  differing): kernels that sum in another order flip near ties, so only a broken kernel's drift
  fails it (on a GPU, first tokens differing for more than a third of the prompts).
* sampling (temperature 1, fp32): a seed gives the same tokens twice (n=1 and n=3); choice i of a
  seeded n=3 request equals an n=1 request seeded seed+i; a seeded request gives the same tokens
  alone and in a batch with others; unseeded n=1 and n=3 requests with top-k / top-p finish.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from scripts.gpu.common import CheckContext, Report, free_device_memory, token_mismatch
from scripts.gpu.models import SMALL, TINY, hf_greedy, load_hf
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams

BACKEND_CANDIDATES = ("torch", "triton")
BF16_MIN_FIRST_AGREE = 2 / 3


@dataclasses.dataclass(frozen=True)
class Variant:
    """Engine settings beyond the defaults; None leaves the field out (or it does not exist)."""

    attention_backend: Optional[str] = None
    enforce_eager: Optional[bool] = None

    @property
    def name(self) -> str:
        graphs = {None: "", True: "/eager", False: "/cuda-graphs"}[self.enforce_eager]
        return f"{self.attention_backend or 'default'}{graphs}"

    def kwargs(self) -> Dict[str, object]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def attention_backends(config_cls=EngineConfig) -> List[Optional[str]]:
    """The backends to run: each candidate (and a concrete default that is not one) when
    ``config_cls`` has an ``attention_backend`` field, else ``[None]`` (the engine's one
    attention). ``auto`` is not run apart: it is one of the others on each device."""
    field = {f.name: f for f in dataclasses.fields(config_cls)}.get("attention_backend")
    if field is None:
        return [None]
    extra = [field.default] if field.default not in (*BACKEND_CANDIDATES, "auto") else []
    return [*BACKEND_CANDIDATES, *extra]


def default_backend(device: torch.device, config_cls=EngineConfig) -> Optional[str]:
    """The backend an engine on ``device`` runs when none is asked for (None: unknown, or no
    ``attention_backend`` field)."""
    field = {f.name: f for f in dataclasses.fields(config_cls)}.get("attention_backend")
    if field is None or field.default != "auto":
        return None if field is None else field.default
    try:
        from kv.attention.backend import resolve_attention_backend
        return resolve_attention_backend("auto", device)
    except (ImportError, ValueError):
        return None


def graph_modes(config_cls=EngineConfig) -> List[Optional[bool]]:
    """``enforce_eager`` values to run: CUDA graphs on and off when the field exists."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return [False, True] if "enforce_eager" in names else [None]


def variants(config_cls=EngineConfig) -> List[Variant]:
    return [Variant(b, e) for b in attention_backends(config_cls) for e in graph_modes(config_cls)]


def report_detection(report: Report, config_cls=EngineConfig) -> None:
    names = {f.name for f in dataclasses.fields(config_cls)}
    for field_name, what in (("attention_backend", "attention backends"),
                             ("enforce_eager", "CUDA graphs on/off")):
        if field_name not in names:
            report.unavailable(what, f"EngineConfig has no {field_name} field")


def engine_config(ctx: CheckContext, variant: Variant, dtype: str) -> EngineConfig:
    """The parity engine's config for ``variant`` (``ValueError`` if ``EngineConfig`` refuses
    it). The step's token budget is below the longest prompt, which is prefilled in chunks."""
    quick = ctx.quick
    return EngineConfig(model=str(ctx.parity_model()), device=ctx.device.type, dtype=dtype,
                        block_size=16, num_kv_blocks=64 if quick else 512,
                        max_num_batched_tokens=64 if quick else 256, seed=0, **variant.kwargs())


def parity_prompts(ctx: CheckContext) -> Tuple[List[List[int]], int]:
    """Prompts of many lengths (partial and several blocks, one past the step's token budget so
    it is prefilled in chunks, two sharing a 32-token prefix) and the new tokens to generate."""
    vocab = int((TINY if ctx.quick else SMALL)["vocab_size"])
    lengths = [5, 17, 33, 48, 90] if ctx.quick else [3, 16, 17, 40, 100, 190, 333, 600]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    shared = prompts[2][:32]
    prompts.append(shared + [rng.randrange(3, vocab) for _ in range(9)])
    return prompts, 8 if ctx.quick else 24


def _variant_runs(ctx: CheckContext, report: Report, variant: Variant, dtype: str,
                  run, label: str):
    """``run(llm)`` on the variant's engine; a refused config or a missing package is reported
    as not available; any other exception fails the check ``label`` and is printed."""
    if (variant.attention_backend == "triton" and not ctx.is_cuda
            and importlib.util.find_spec("triton") is None):
        report.unavailable(label, "the triton package is not installed here")
        return None
    try:
        config = engine_config(ctx, variant, dtype)
    except ValueError as exc:
        report.unavailable(label, f"EngineConfig refused it: {exc}")
        return None
    try:
        with LLM(config) as llm:
            return run(llm)
    except Exception as exc:  # noqa: BLE001 - one variant must not hide the others
        # A GPU machine has triton and cupy; on CPU a missing package is the machine's lack.
        if isinstance(exc, ImportError) and not ctx.is_cuda:
            report.unavailable(label, f"{type(exc).__name__}: {exc}")
        else:
            traceback.print_exc()
            report.check(label, False, f"{type(exc).__name__}: {exc}")
    finally:
        free_device_memory()
    return None


def _greedy_twice(prompts, max_new: int):
    params = SamplingParams(max_tokens=max_new, temperature=0.0)

    def run(llm: LLM):
        first = [o.output_token_ids for o in llm.generate(prompts, params)]
        second = [o.output_token_ids for o in llm.generate(prompts, params)]
        return first, second, graph_steps(llm)
    return run


def graph_steps(llm: LLM) -> int:
    """Decode steps the engine ran through CUDA graphs (0 when it has none)."""
    graphs = getattr(llm.engine.rank.runner, "graphs", None)
    return graphs.num_runs if graphs is not None else 0


def check_greedy(ctx: CheckContext, report: Report) -> None:
    report_detection(report)
    prompts, max_new = parity_prompts(ctx)
    hf = load_hf(ctx.parity_model(), ctx.device, torch.float32)
    reference = hf_greedy(hf, prompts, max_new)
    del hf
    free_device_memory()
    for variant in variants():
        label = f"fp32 {variant.name} equals transformers"
        got = _variant_runs(ctx, report, variant, "float32", _greedy_twice(prompts, max_new),
                            label)
        if got is None:
            continue
        report.check(label, got[0] == reference and got[1] == reference,
                     _mismatch_detail(got[:2], reference))
        if ctx.is_cuda and variant.attention_backend == "triton" and variant.enforce_eager is False:
            report.check(f"{variant.name} replays decode graphs", got[2] > 0,
                         f"{got[2]} decode steps through graphs")
    _check_bf16(ctx, report, prompts, max_new)


def _mismatch_detail(got, reference) -> str:
    first, second = (token_mismatch(g, reference)["token_mismatch_rate"] for g in got)
    return f"token mismatch rate {first:.3f} (first pass), {second:.3f} (prefix-cache pass)"


def _check_bf16(ctx: CheckContext, report: Report, prompts, max_new: int) -> None:
    """bf16 drift from ``transformers`` in bf16. On a GPU the prefill's argmax (the first token,
    before any divergence compounds) must agree for at least ``BF16_MIN_FIRST_AGREE`` of the
    prompts: rounding flips a near tie, a broken kernel flips most. Triton's CPU interpreter
    does not do bf16 arithmetic as a GPU does, so that pair is not run."""
    hf = load_hf(ctx.parity_model(), ctx.device, torch.bfloat16)
    reference = hf_greedy(hf, prompts, max_new)
    del hf
    free_device_memory()
    for backend in attention_backends():
        variant = Variant(backend)
        label = f"bf16 {variant.name}"
        if backend == "triton" and not ctx.is_cuda:
            report.unavailable(label, "not run on CPU: Triton's interpreter is not a GPU's bf16")
            continue
        got = _variant_runs(ctx, report, variant, "bfloat16", _greedy_twice(prompts, max_new),
                            label)
        if got is None:
            continue
        drift = token_mismatch(got[0], reference)  # got: first pass, second pass, graph steps
        for key, value in drift.items():
            report.figure(f"{label} {key}", value)
        agree = 1.0 - drift["first_token_mismatch_rate"]
        report.check(f"{label} completes", all(len(g) > 0 for g in got[0] + got[1]))
        report.check(f"{label} first tokens agree with transformers bf16 (at least "
                     f"{BF16_MIN_FIRST_AGREE:.0%})", agree >= BF16_MIN_FIRST_AGREE,
                     f"{agree:.0%} agree")


# ----- sampling -----


def _sampled(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, **kwargs)


def _ids(outputs) -> List[List[int]]:
    return [o.output_token_ids for o in outputs]


def sampling_runs(llm: LLM, prompts: Sequence[List[int]], k: int) -> Dict[str, object]:
    """Every generation the sampling checks compare, from one engine."""
    a, b, c, d = prompts
    batch = _ids(llm.generate([c, a, b, d], [_sampled(k), _sampled(k, seed=1234),
                                             _sampled(k, seed=77, n=3),
                                             _sampled(k, n=3, top_k=20, top_p=0.9)]))
    return {
        "alone": _ids(llm.generate([a], _sampled(k, seed=1234))),
        "alone_again": _ids(llm.generate([a], _sampled(k, seed=1234))),
        "n3": _ids(llm.generate([b], _sampled(k, seed=77, n=3))),
        "n3_again": _ids(llm.generate([b], _sampled(k, seed=77, n=3))),
        "per_seed": [_ids(llm.generate([b], _sampled(k, seed=77 + i)))[0] for i in range(3)],
        "batch": batch,
    }


def sampling_checks(runs: Dict[str, object], k: int) -> Dict[str, bool]:
    batch = runs["batch"]  # [c, a, b x3, d x3]
    return {
        "n=1 same seed, same tokens twice": runs["alone"] == runs["alone_again"],
        "n=3 same seed, same tokens twice": runs["n3"] == runs["n3_again"],
        "n=3 choice i draws from seed+i": runs["n3"] == runs["per_seed"],
        "n=1 seeded: alone equals in a batch": batch[1] == runs["alone"][0],
        "n=3 seeded: alone equals in a batch": batch[2:5] == runs["n3"],
        "unseeded n=1 and n=3 (top-k, top-p) finish": (len(batch) == 8 and all(
            len(ids) == k for ids in batch)),
    }


def check_sampling(ctx: CheckContext, report: Report) -> None:
    """Temperature 1, fp32, the default attention backend, each CUDA-graph mode offered."""
    prompts, _ = parity_prompts(ctx)
    k = 8 if ctx.quick else 16
    for eager in graph_modes():
        variant = Variant(enforce_eager=eager)
        runs = _variant_runs(ctx, report, variant, "float32",
                             lambda llm: sampling_runs(llm, prompts[1:5], k),
                             f"{variant.name} sampling")
        if runs is None:
            continue
        for name, ok in sampling_checks(runs, k).items():
            report.check(f"{variant.name}: {name}", ok)
        report.figure(f"{variant.name} n=3 distinct choices", len({tuple(c) for c in runs["n3"]}))
