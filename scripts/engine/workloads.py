"""``bench_engine.py``'s workloads: seeded random token ids (valid ids of the model's vocabulary,
no shared prefixes) with the lengths of an Azure trace (prefill-heavy) or short prompts with long
outputs (decode-heavy); every request fits the model's context."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from scripts.traces import TraceRequest

DECODE_PROMPT_RANGE = (16, 48)
DECODE_OUTPUT_RANGE = (64, 128)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: List[List[int]]
    max_tokens: List[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def clamp_lengths(prompt_len: int, output_len: int, max_model_len: int,
                  max_output: Optional[int]) -> Tuple[int, int]:
    """Fit one request in the context: 1 <= output <= max_output, 1 <= prompt, sum <= context."""
    cap = max_model_len - 1 if max_output is None else min(max_output, max_model_len - 1)
    output_len = max(1, min(output_len, cap))
    prompt_len = max(1, min(prompt_len, max_model_len - output_len))
    return prompt_len, output_len


def random_prompts(lengths: Sequence[int], vocab_size: int, rng: random.Random) -> List[List[int]]:
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def prefill_workload(rows: Sequence[TraceRequest], args: argparse.Namespace,
                     max_model_len: int, vocab_size: int) -> Workload:
    lengths = [clamp_lengths(round(r.num_prompt_tokens * args.prompt_scale),
                             round(r.num_output_tokens * args.output_scale), max_model_len,
                             args.max_output) for r in rows]
    rng = random.Random(args.seed)
    return Workload("prefill-heavy", random_prompts([p for p, _ in lengths], vocab_size, rng),
                    [o for _, o in lengths])


def decode_workload(args: argparse.Namespace, max_model_len: int, vocab_size: int) -> Workload:
    rng = random.Random(args.seed + 1)
    lengths = [clamp_lengths(rng.randint(*DECODE_PROMPT_RANGE), rng.randint(*DECODE_OUTPUT_RANGE),
                             max_model_len, args.max_output)
               for _ in range(args.decode_requests)]
    return Workload("decode-heavy", random_prompts([p for p, _ in lengths], vocab_size, rng),
                    [o for _, o in lengths])
