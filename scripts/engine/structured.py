"""``bench_engine.py --structured``: what constrained decoding costs a decode step.

One batch of ``--structured-batch`` chat requests (the model's chat template) runs two ways, in
the same process, one after the other, for ``--structured-rounds`` rounds (interleaved, so a
busy shared machine weighs on each alike):

* ``plain``: every request unconstrained (``ignore_eos``, ``--structured-tokens`` tokens);
* ``constrained``: the same, but every second request constrained by `PROFILE_SCHEMA` (a
  nested object of 10 fields: bounded strings, enums, integers, a number, a boolean, an array).

The figure is the mean duration of the decode steps that sample the whole batch (a constrained
request stops when its JSON is complete; steps after that have fewer rows and are not counted):
``overhead = mean(constrained) / mean(plain) - 1``. Greedy throughout; grammars are compiled
(and cached) before the first timed round.

On a shared machine whole runs drift by more than the overhead, so every constrained run also
times the mask work of its steps (filling the masks, applying them, advancing the matchers):
``mask_share`` is that time over the run's step time, measured in the same steps, the overhead
that no load drift can hide.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Callable, Dict, Iterator, List, Sequence

from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.structured.matcher import TokenMask
from workers.structured.spec import StructuredOutput

PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "email": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string", "maxLength": 40},
                           "city": {"type": "string", "maxLength": 24},
                           "country": {"enum": ["FR", "DE", "US", "JP", "BR"]}},
            "required": ["street", "city", "country"], "additionalProperties": False,
        },
        "bio": {"type": "string", "maxLength": 80},
        "joined_year": {"type": "integer", "minimum": 1990, "maximum": 2030},
    },
    "required": ["name", "email", "age", "role", "active", "score", "tags", "address", "bio",
                 "joined_year"],
    "additionalProperties": False,
}
SUBJECTS = ["a violinist from Lyon", "a retired sailor", "a data engineer in Osaka",
            "a beekeeper", "a chess coach", "a nurse in Recife", "a carpenter", "a student"]
MODES = ("plain", "constrained")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured", action="store_true",
                   help="measure constrained decoding instead: decode step time with half the "
                        "batch constrained by a JSON schema, against the batch unconstrained")
    p.add_argument("--structured-batch", type=int, default=16, help="requests per batch")
    p.add_argument("--structured-tokens", type=int, default=160,
                   help="tokens per unconstrained request (the most per constrained one)")
    p.add_argument("--structured-rounds", type=int, default=3, help="rounds of the two runs")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.structured_batch < 2:
        p.error("--structured-batch must be at least 2 (half of it is constrained)")
    for name in ("structured_tokens", "structured_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")


def prompts(llm: LLM, batch: int) -> List[str]:
    tokenizer = llm.engine.tokenizer
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a JSON profile of {SUBJECTS[i % len(SUBJECTS)]} "
                                     f"(number {i})."}],
        tokenize=False, add_generation_prompt=True) for i in range(batch)]


def batch_params(mode: str, batch: int, max_tokens: int) -> List[SamplingParams]:
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if mode == "plain":
        return [plain] * batch
    schema = StructuredOutput("json_schema", json.dumps(PROFILE_SCHEMA), any_whitespace=False)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=schema)
    return [constrained if i % 2 else plain for i in range(batch)]


@contextlib.contextmanager
def timed_mask_work(structured) -> Iterator[List[float]]:
    """Seconds spent in the engine's mask work, summed into ``[total]``."""
    total = [0.0]

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - started
        return wrapper

    saved = TokenMask.apply
    TokenMask.apply = timed(TokenMask.apply)
    structured.masks = timed(structured.masks)
    structured.accept = timed(structured.accept)
    try:
        yield total
    finally:
        TokenMask.apply = saved
        del structured.masks, structured.accept


def run_mode(llm: LLM, mode: str, texts: Sequence[str], max_tokens: int) -> Dict[str, float]:
    engine = llm.engine
    first = len(engine.step_records)
    started = time.perf_counter()
    with timed_mask_work(engine.structured) as mask_s:
        outs = llm.generate(texts, batch_params(mode, len(texts), max_tokens))
    wall_s = time.perf_counter() - started
    steps = engine.step_records[first:]
    full = [r.duration_s for r in steps if r.is_decode_only and len(r.seqs) == len(texts)]
    if not full:
        raise RuntimeError(f"{mode}: no decode step sampled the whole batch")
    finished = [o for o in outs[1::2]] if mode != "plain" else []
    stopped = [o for o in finished if o.finish_reason == "stop"]
    valid = sum(_is_valid(o.text) for o in stopped)
    return {"step_ms": 1000 * statistics.mean(full), "num_steps": len(full), "wall_s": wall_s,
            "mask_share": mask_s[0] / sum(r.duration_s for r in steps),
            "tokens": sum(len(o.output_token_ids) for o in outs),
            "constrained_valid": valid, "constrained_stopped": len(stopped),
            "constrained_total": len(finished)}


def _is_valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PROFILE_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured(llm: LLM, args: argparse.Namespace) -> Dict[str, object]:
    texts = prompts(llm, args.structured_batch)
    run_mode(llm, "constrained", texts[:2], 8)  # compiles the grammar, warms every path
    rounds: Dict[str, List[Dict[str, float]]] = {mode: [] for mode in MODES}
    for round_index in range(args.structured_rounds):
        for mode in MODES:
            result = run_mode(llm, mode, texts, args.structured_tokens)
            rounds[mode].append(result)
            print(f"  round {round_index + 1} {mode:<17}{result['step_ms']:7.2f} ms/step over "
                  f"{result['num_steps']} full steps, masks {100 * result['mask_share']:.2f}% "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    step_ms = {mode: statistics.median(r["step_ms"] for r in rounds[mode]) for mode in MODES}
    result: Dict[str, object] = {f"{mode}_step_ms": step_ms[mode] for mode in MODES}
    result["overhead_frac"] = step_ms["constrained"] / step_ms["plain"] - 1
    result["mask_share"] = statistics.median(r["mask_share"] for r in rounds["constrained"])
    last = rounds["constrained"][-1]
    result.update(batch=args.structured_batch, max_tokens=args.structured_tokens,
                  rounds=args.structured_rounds, constrained_valid=last["constrained_valid"],
                  constrained_stopped=last["constrained_stopped"],
                  constrained_total=last["constrained_total"])
    print(f"\nconstrained / plain decode step: {1 + result['overhead_frac']:.3f}; mask work: "
          f"{100 * result['mask_share']:.2f}% of the constrained steps' time; "
          f"of {last['constrained_total']} constrained outputs {last['constrained_stopped']} "
          f"complete (the others reached max_tokens), {last['constrained_valid']} of them valid")
    return result
