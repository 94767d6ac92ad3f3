"""`tpserve generate`: offline generation for a batch of prompts (all submitted together)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Union

from kv.write_policy import WRITE_POLICIES
from workers.config import EngineConfig
from workers.sampling_params import SamplingParams

Prompt = Union[str, List[int]]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that runs a model."""
    parser.add_argument("--model", default="default",
                        help="checkpoint directory, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-blocks", type=int, default=None, help="cap on device KV blocks")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0,
                        help="device KV pool per rank in GiB (when --kv-blocks is not set)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="CUDA: the fraction of each GPU the rank may use; the KV pool "
                             "takes what it leaves after the weights and the largest step "
                             "(instead of --kv-cache-gb; --kv-blocks caps it)")
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one step (chunked prefill)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="requests per step")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                        help="attention kernels: torch (PyTorch reference) or triton (paged "
                             "kernels; on CPU only under TRITON_INTERPRET=1); auto: triton on "
                             "CUDA, torch on CPU")
    parser.add_argument("--step-timeout-s", type=float, default=30.0,
                        help="how long a collective of a TP group may wait, and the floor of "
                             "the deadline after which a serving group with a hung rank is "
                             "declared failed (default 30)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: every decode step launches its kernels (by "
                             "default decode steps replay CUDA graphs on CUDA with the triton "
                             "backend)")
    tiers = parser.add_argument_group("KV tiers (per rank)")
    tiers.add_argument("--host-kv-gb", type=float, default=0.0,
                       help="host-memory KV tier in GiB (0: none)")
    tiers.add_argument("--host-kv-blocks", type=int, default=None,
                       help="host-memory KV tier in blocks (instead of --host-kv-gb)")
    tiers.add_argument("--disk-kv-dir", default=None,
                       help="directory of the disk KV tier, or a comma-separated list (one per "
                            "drive) that its blocks are striped over")
    tiers.add_argument("--disk-kv-gb", type=float, default=0.0,
                       help="disk KV tier in GiB (all directories together)")
    tiers.add_argument("--disk-kv-blocks", type=int, default=None,
                       help="disk KV tier in blocks (instead of --disk-kv-gb)")
    tiers.add_argument("--kv-eviction", default="lru", choices=("lru", "hotness"),
                       help="eviction policy of every tier")
    tiers.add_argument("--kv-hotness-decay", type=float, default=0.95,
                       help="hotness: decay of the per-request moving average of accesses")
    tiers.add_argument("--kv-pin-threshold", type=float, default=0.9,
                       help="hotness: blocks above this are held on the device "
                            "(evicted only as a last resort; a copy is kept on host)")
    tiers.add_argument("--kv-write-policy", default="write_through", choices=WRITE_POLICIES,
                       help="when a block goes down a tier: write_through (when released), "
                            "write_through_selective (when released, once hit "
                            "--kv-write-threshold times), write_back (when evicted above)")
    tiers.add_argument("--kv-write-threshold", type=int, default=1,
                       help="write_through_selective: prefix hits a block needs to go down")
    tiers.add_argument("--kv-spill-gbps", type=float, default=None,
                       help="bound on write-through spill bandwidth per rank in GB/s (default: "
                            "none); spills queue behind it and are dropped if evicted first")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, tp_size=args.tp, block_size=args.block_size,
        num_kv_blocks=args.kv_blocks, kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_cache=not args.no_prefix_cache,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        step_timeout_s=args.step_timeout_s,
        seed=args.seed if args.seed is not None else 0,
        host_kv_gb=args.host_kv_gb, host_kv_blocks=args.host_kv_blocks,
        disk_kv_dir=args.disk_kv_dir, disk_kv_gb=args.disk_kv_gb,
        disk_kv_blocks=args.disk_kv_blocks, kv_eviction=args.kv_eviction,
        kv_hotness_decay=args.kv_hotness_decay, kv_pin_threshold=args.kv_pin_threshold,
        kv_write_policy=args.kv_write_policy, kv_write_threshold=args.kv_write_threshold,
        kv_spill_gbps=args.kv_spill_gbps,
    )


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
    with LLM(engine_config(args)) as llm:
        outputs = llm.generate(prompts, params)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids,
                              "output_token_ids": out.output_token_ids, "text": out.text}))
        else:
            print(out.text)
    return 0
