#!/usr/bin/env python3
"""How far tpserve's bf16 on CPU drifts from `transformers`, measured as the GPU check measures it
(``scripts/gpu/parity.py``): greedy ids on the same prompts, token mismatch rate, share of
sequences equal, share of first tokens (the prefill's argmax) differing; against `transformers`
in bf16 and in fp32. tpserve's fp32 against `transformers`' fp32 is run beside it (the parity
the suite holds: 0 mismatches).

    PYTHONPATH=$PWD .venv/bin/python -m scripts.cpu_bf16_drift [--models default,tiny,small]
        [--max-new 24]

Models: ``default`` (SmolLM2-135M, materialized on first use), ``tiny`` and ``small`` (the GPU
check's random Llamas, ``scripts/gpu/models.py``, built in a temporary folder), or a checkpoint
directory. Prompts: random token ids of several lengths (seeded). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from scripts.gpu.common import token_mismatch
from scripts.gpu.models import SMALL, TINY, build_checkpoint, hf_greedy, load_hf
from workers.config import EngineConfig
from workers.default_model import resolve_model_path
from workers.llm import LLM
from workers.model_config import load_model_config
from workers.sampling_params import SamplingParams

BUILT = {"tiny": TINY, "small": SMALL}
PROMPT_LENGTHS = (3, 16, 17, 40, 100, 190)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="default,tiny,small",
                   help="comma-separated: default, tiny, small or checkpoint directories")
    p.add_argument("--max-new", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models:
        p.error("--models: expected at least one model")
    if args.max_new < 1:
        p.error("--max-new must be at least 1")
    return args


def model_dir(name: str, scratch: Path) -> Path:
    """The checkpoint for ``name``: built (tiny, small), materialized (default) or as given."""
    if name in BUILT:
        build_checkpoint(scratch / name, BUILT[name])
        return scratch / name
    return resolve_model_path(name)


def prompts_for(path: Path, seed: int) -> List[List[int]]:
    vocab = load_model_config(path).vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def tpserve_greedy(path: Path, dtype: str, prompts, max_new: int) -> List[List[int]]:
    config = EngineConfig(model=str(path), device="cpu", dtype=dtype, block_size=16,
                          num_kv_blocks=256, seed=0)
    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    with LLM(config) as llm:
        return [o.output_token_ids for o in llm.generate(prompts, params)]


def drift(path: Path, args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    """Each comparison's `token_mismatch` figures, named ``tpserve-DTYPE vs hf-DTYPE``."""
    prompts = prompts_for(path, args.seed)
    hf = {name: hf_greedy(load_hf(path, torch.device("cpu"), dtype), prompts, args.max_new)
          for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    ours = {name: tpserve_greedy(path, dtype, prompts, args.max_new)
            for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32"))}
    pairs = (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32"))
    return {f"tpserve-{a} vs hf-{b}": token_mismatch(ours[a], hf[b]) for a, b in pairs}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    results: Dict[str, object] = {"max_new": args.max_new, "prompt_lengths": PROMPT_LENGTHS}
    print(f"{'model':<10} {'comparison':<26} {'mismatch':>9} {'seqs equal':>11} "
          f"{'first differ':>13}")
    with tempfile.TemporaryDirectory(prefix="bf16-drift-") as scratch:
        for name in args.models:
            try:
                path = model_dir(name, Path(scratch))
            except (OSError, ValueError) as exc:
                print(f"error: --models {name}: {exc}", file=sys.stderr)
                return 2
            figures = drift(path, args)
            results[name] = figures
            for comparison, f in figures.items():
                print(f"{name:<10} {comparison:<26} {f['token_mismatch_rate']:9.3f} "
                      f"{f['seqs_equal_frac']:11.2f} {f['first_token_mismatch_rate']:13.2f}",
                      flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
