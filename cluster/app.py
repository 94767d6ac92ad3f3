"""The Serve application: an OpenAI-compatible ingress in front of N tensor-parallel groups.

Resource requests are derived here, in one place, from the configuration and the cluster: a GPU
per rank on GPU clusters; on CPU-only hosts a fractional CPU share per rank so that every group's
placement group fits beside the others (a 2-core host runs 2 groups of TP 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from cluster.autoscaling import KVLoadPolicy
from cluster.group_deployment import GroupResources, TPGroupServer
from cluster.ingress import build_ingress
from cluster.kv_router import KVAwareRouter
from workers.config import EngineConfig
from workers.default_model import resolve_model_path
from workers.engine_sizing import check_model, context_length, fit_context_to_pool
from workers.model_config import ModelConfig, load_model_config


ROUTERS = ("kv", "kv_strict", "pow2", "prefix_affinity", "round_robin")


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig
    min_groups: int = 1
    max_groups: int = 1
    kv_target_occupancy: float = 0.70
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    routing_stats_period_s: float = 0.5
    placement_strategy: str = "PACK"  # of each group's ranks: PACK, SPREAD, STRICT_PACK/SPREAD
    # "kv": tpserve's KV-aware router ("kv_strict": with its former prefix-first order);
    # baselines (cluster/baseline_routers.py): "pow2" (Serve's default), "prefix_affinity",
    # "round_robin"
    router: str = "kv"
    max_ongoing_requests: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.min_groups <= self.max_groups:
            raise ValueError(f"--groups must be N or MIN:MAX with 1 <= MIN <= MAX, got "
                             f"{self.min_groups}:{self.max_groups}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not 0.0 < self.kv_target_occupancy <= 1.0:
            raise ValueError(f"--kv-target-occupancy must be in (0, 1], got "
                             f"{self.kv_target_occupancy}")


def check_serve_config(config: ServeConfig) -> None:
    """What every group replica would find out in its constructor, found out before anything
    is deployed (``workers.engine_sizing``). Raises ``ValueError`` / ``OSError``."""
    _, model = check_model(config.engine)
    served_context_length(config.engine, model)


def served_context_length(engine: EngineConfig, model: ModelConfig) -> int:
    """The context the groups serve: the model's or the one asked for, lowered (or refused)
    as the engines do when ``--kv-blocks`` holds less."""
    wanted = context_length(engine, model)
    if engine.num_kv_blocks is None:
        return wanted  # sized from --kv-cache-gb and the dtype: the engine decides
    return fit_context_to_pool(engine, wanted, engine.num_kv_blocks)


def parse_groups(text: str) -> tuple:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise ValueError(f"--groups must be N or MIN:MAX, got {text!r}") from None
    if len(parts) not in (1, 2):
        raise ValueError(f"--groups must be N or MIN:MAX, got {text!r}")
    return parts[0], parts[-1]


def group_resources(config: ServeConfig, cluster: Dict[str, float]) -> GroupResources:
    """One GPU per rank where GPUs are used; else an equal share of the cluster's CPUs."""
    engine = config.engine
    use_gpus = engine.device == "cuda" or (engine.device == "auto" and cluster.get("GPU", 0) > 0)
    if use_gpus:
        return GroupResources(cpus_per_rank=1.0, gpus_per_rank=1.0)
    num_ranks = engine.tp_size * config.max_groups
    share = math.floor(cluster.get("CPU", 1.0) / num_ranks * 10) / 10
    return GroupResources(cpus_per_rank=min(1.0, max(0.1, share)), gpus_per_rank=0.0)


def router_config(config: ServeConfig) -> RequestRouterConfig:
    """The group deployment's router: tpserve's KV-aware one, or one of Serve's to compare."""
    stats = dict(request_routing_stats_period_s=config.routing_stats_period_s,
                 request_routing_stats_timeout_s=max(1.0, config.routing_stats_period_s * 2))
    if config.router == "pow2":
        return RequestRouterConfig(**stats)
    if config.router in ("prefix_affinity", "round_robin"):
        from cluster import baseline_routers

        cls = (baseline_routers.TokenPrefixAffinityRouter if config.router == "prefix_affinity"
               else baseline_routers.RoundRobinRouter)
        return RequestRouterConfig(request_router_class=cls, **stats)
    kwargs = {"target_occupancy": config.kv_target_occupancy}
    if config.router == "kv_strict":
        kwargs["load_weight"] = 0.0
    return RequestRouterConfig(request_router_class=KVAwareRouter,
                               request_router_kwargs=kwargs, **stats)


def build_app(config: ServeConfig, cluster: Dict[str, float]):
    """The Serve application for ``config`` on a cluster with resources ``cluster``."""
    engine = config.engine
    model_dir = resolve_model_path(engine.model)
    engine = EngineConfig(**{**engine.__dict__, "model": str(model_dir)})
    resources = group_resources(config, cluster)
    scaling: Dict = {"num_replicas": config.min_groups}
    if config.max_groups > config.min_groups:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=config.min_groups, max_replicas=config.max_groups,
            policy=AutoscalingPolicy(
                policy_function=KVLoadPolicy,
                policy_kwargs={"target_occupancy": config.kv_target_occupancy}))}
    groups = serve.deployment(TPGroupServer).options(
        name="TPGroup",
        placement_group_bundles=resources.bundles(engine.tp_size),
        placement_group_strategy=config.placement_strategy,
        ray_actor_options={"num_cpus": resources.cpus_per_rank,
                           "num_gpus": resources.gpus_per_rank},
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=2.0,
        request_router_config=router_config(config),
        **scaling,
    ).bind(engine, resources)
    name = config.served_model_name or model_dir.name
    return build_ingress(groups, model_dir=str(model_dir), served_model_name=name,
                         block_size=engine.block_size,
                         max_model_len=served_context_length(engine, load_model_config(model_dir)),
                         api_key=config.api_key)
