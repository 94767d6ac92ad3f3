"""The options of every command that runs a model, and of `serve`: one definition that the CLI
(`cluster.cli`), a Serve config file's ``args`` (`cluster.serve_config`) and the configuration
page (docs/configuration.md) are built from."""

from __future__ import annotations

import argparse
import os

from kv.tiers.write_policy import WRITE_POLICIES
from workers.config import EngineConfig

# Ray's placement group strategies, for --placement-strategy (here: the CLI imports no Ray).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")



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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `serve` beyond the engine's (also the keys of a Serve config file's args)."""
    parser.add_argument("--groups", default="1", help="TP groups: N, or MIN:MAX to autoscale")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--kv-target-occupancy", type=float, default=0.70,
                        help="router's KV occupancy target per group (default 0.70)")
    parser.add_argument("--api-key", default=os.environ.get("TPSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default $TPSERVE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API")
    parser.add_argument("--max-migrations", type=int, default=3,
                        help="re-sends of a request to another group when its group fails "
                             "while serving it (the stream continues; 0: fail it)")
    parser.add_argument("--placement", choices=("auto", "plan", "serve"), default="auto",
                        help="who places each TP group: the topology plan (probes every node) "
                             "or Serve; auto: the plan on GPU clusters for a fixed --groups N, "
                             "Serve for --groups MIN:MAX (its placement groups are demand "
                             "Ray's autoscaler sees) (default)")
    parser.add_argument("--placement-strategy", default=None, choices=PLACEMENT_STRATEGIES,
                        help="how Serve places a group's ranks (Ray's placement group "
                             "strategy), where Serve places the groups: PACK (default, as Ray "
                             "Serve LLM: one node where one has room, else across nodes), "
                             "STRICT_PACK (one node, or wait), SPREAD, STRICT_SPREAD")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests each ingress lets wait for a busy TP group; beyond "
                             "them 429 with Retry-After (default: one more round of the "
                             "groups' capacity)")
    parser.add_argument("--max-request-body-mb", type=float, default=4.0,
                        help="largest request body in MiB; larger ones get 413 (default 4)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="a request still running after this is aborted with 504; a "
                             "client may ask for less with X-Request-Timeout (default 600)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat templates sent in requests (chat_template, "
                             "chat_template_kwargs.chat_template): Jinja the ingress runs, "
                             "bounded in time and size; without it they get 400")
