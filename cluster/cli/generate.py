"""`tpserve generate`: offline generation for a batch of prompts (all submitted together)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Union

from cluster.options import add_engine_arguments, engine_config
from workers.sampling_params import SamplingParams

Prompt = Union[str, List[int]]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate completions offline")
    add_engine_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--json", action="store_true", help="one JSON line per prompt")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", nargs="+", help="prompt text(s)")
    source.add_argument("--prompts-file", type=Path,
                        help='JSONL: {"prompt": "text"} or {"prompt_token_ids": [ints]} per line')
    parser.set_defaults(func=run)


def read_prompts_file(path: Path) -> List[Prompt]:
    """Prompts of a JSONL file; an error names the line and what was expected."""
    prompts: List[Prompt] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("prompt_token_ids"), list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item["prompt_token_ids"]):
            prompts.append(item["prompt_token_ids"])
        else:
            raise ValueError(f'{where}: expected {{"prompt": "text"}} or '
                             f'{{"prompt_token_ids": [ints]}}, got {line.strip()[:80]}')
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def run(args: argparse.Namespace) -> int:
    from workers.llm import LLM

    prompts: List[Prompt] = args.prompt if args.prompt else read_prompts_file(args.prompts_file)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    config = engine_config(args)
    with LLM(config, bind_cpu_cores=config.cpu_binding == "auto") as llm:
        outputs = llm.generate(prompts, params)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids,
                              "output_token_ids": out.output_token_ids, "text": out.text}))
        else:
            print(out.text)
    return 0
