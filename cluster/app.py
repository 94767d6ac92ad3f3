"""The Serve application: an OpenAI-compatible ingress in front of N tensor-parallel groups.

Resource requests are derived here, in one place, from the configuration and the cluster: a GPU
per rank on GPU clusters; on CPU-only hosts a fractional CPU share per rank so that every group's
placement group fits beside the others (a 2-core host runs 2 groups of TP 2).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace
from typing import Any, Dict, Optional, Tuple

from ray import serve
from ray.serve.config import (
    AutoscalingConfig,
    AutoscalingPolicy,
    BackpressureConfig,
    RequestRouterConfig,
)

from cluster.app_config import (  # noqa: F401 (parse_groups re-exported)
    ServeConfig, ingress_replicas, parse_groups)
from cluster.api.api_key import resolve_api_key
from cluster.api.admission import group_max_ongoing_requests, ingress_max_in_flight
from cluster.groups.autoscaling import KVLoadPolicy
from cluster.groups.formation import FormationConfig
from cluster.groups.deployment import GroupResources, PlannedPlacement, TPGroupServer
from cluster.api.ingress import build_ingress
from cluster.routing.kv_router import KVAwareRouter
from cluster.routing.ranking import DEFAULT_MAX_REPORT_AGE_S
from cluster.api.request_limits import MIB, IngressLimits
from cluster.routing.settings import RouterSettings
from workers.config import EngineConfig
from workers.default_model import resolve_model_path
from workers.engine_sizing import check_model, context_length, fit_context_to_pool
from workers.model_config import ModelConfig, load_model_config


logger = logging.getLogger(__name__)


def request_limits(config: ServeConfig) -> Tuple[int, int, IngressLimits]:
    """A group's ``max_ongoing_requests``, the ingress's ``max_queued_requests`` for the groups,
    and the ingress's own limits, all derived here from the configuration."""
    engine = config.engine
    per_group = config.max_ongoing_requests or group_max_ongoing_requests(
        engine.max_num_seqs, engine.num_kv_blocks)
    queued = config.max_queued_requests or per_group * config.max_groups
    limits = IngressLimits(
        max_in_flight=ingress_max_in_flight(config.max_groups, per_group, queued),
        max_body_bytes=int(config.max_request_body_mb * MIB),
        request_timeout_s=config.request_timeout_s,
        trust_request_chat_template=config.trust_request_chat_template)
    return per_group, queued, limits


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


def group_resources(config: ServeConfig, cluster: Dict[str, float]) -> GroupResources:
    """One GPU per rank where GPUs are used; else an equal share of the cluster's CPUs."""
    engine = config.engine
    use_gpus = engine.device == "cuda" or (engine.device == "auto" and cluster.get("GPU", 0) > 0)
    if use_gpus:
        return GroupResources(cpus_per_rank=1.0, gpus_per_rank=1.0)
    num_ranks = engine.tp_size * config.max_groups
    share = math.floor(cluster.get("CPU", 1.0) / num_ranks * 10) / 10
    return GroupResources(cpus_per_rank=min(1.0, max(0.1, share)), gpus_per_rank=0.0)


def rank_engine_config(engine: EngineConfig, resources: GroupResources,
                       planned: Optional[PlannedPlacement]) -> EngineConfig:
    """The engine config a group's ranks get. A rank that asks Ray for no GPU is shown every GPU
    of its node (Ray sets ``CUDA_VISIBLE_DEVICES`` only for GPUs it assigns): with ``auto`` it
    would choose CUDA, and every rank on the node ``cuda:0``. So where Serve places groups on
    CPU shares (no GPU in the cluster when the app was built), ``auto`` means ``cpu``."""
    if engine.device == "auto" and planned is None and resources.gpus_per_rank == 0:
        return replace(engine, device="cpu")
    return engine


def planned_placement(config: ServeConfig, cluster: Dict[str, float],
                      resources: GroupResources) -> Optional[PlannedPlacement]:
    """The topology plan's placement, or None where Serve places the groups (see `placement`).
    ``auto`` plans a fixed number of groups on a GPU cluster; an autoscaled deployment (MIN <
    MAX) is placed by Serve: a planned replica asks Ray for no resources, so once the plan is
    full no demand reaches the autoscaler and no node is ever added, while Serve's placement
    groups are demand it sees."""
    autoscaled = config.max_groups > config.min_groups
    use_plan = config.placement == "plan" or (config.placement == "auto" and not autoscaled
                                              and cluster.get("GPU", 0) > 0)
    if not use_plan:
        return None
    if config.placement_strategy is not None:  # placement auto: a fixed --groups N on GPUs
        raise ValueError(f"--placement-strategy {config.placement_strategy}: --placement auto "
                         f"chose the topology plan (a GPU cluster, a fixed --groups "
                         f"{config.min_groups}), which places the ranks itself; add --placement "
                         f"serve for Serve to place them by the strategy")
    if autoscaled:
        logger.warning("--placement plan with --groups %d:%d: planned groups grow only onto "
                       "nodes already in the cluster or joining it; Ray's autoscaler does not "
                       "see their demand (--placement auto leaves autoscaled groups to Serve)",
                       config.min_groups, config.max_groups)
    return PlannedPlacement(FormationConfig(
        tp_size=config.engine.tp_size, cpus_per_rank=resources.cpus_per_rank,
        cpu_ranks_per_node=config.cpu_ranks_per_node))


def group_placement_options(resources: GroupResources, tp_size: int, strategy: str,
                            planned: Optional[PlannedPlacement]) -> Dict:
    """Serve's placement options for the group replica: its own placement group of TP bundles,
    or (planned) a thin replica of no resources whose ranks go to the planned bundles."""
    if planned is not None:
        return {"ray_actor_options": {"num_cpus": 0, "num_gpus": 0}}
    return {"placement_group_bundles": resources.bundles(tp_size),
            "placement_group_strategy": strategy,
            "ray_actor_options": {"num_cpus": resources.cpus_per_rank,
                                  "num_gpus": resources.gpus_per_rank}}


def kv_aware_router_config(stats_period_s: float = 0.5, stats_timeout_s: Optional[float] = None,
                           **settings: Any) -> RequestRouterConfig:
    """The ``request_router_config`` of a group deployment, its ``settings`` (`RouterSettings`'
    fields; the rest at their defaults) validated here rather than in the first caller.
    ``max_report_age_s`` defaults to the larger of 5 s and ten stats periods, and a charge no
    report lists expires after twice that; ``block_size`` is the one the callers'
    ``block_hashes`` use (by default, the groups'); the weights are `rank_groups`'."""
    settings.setdefault("max_report_age_s", max(DEFAULT_MAX_REPORT_AGE_S, 10 * stats_period_s))
    settings.setdefault("charge_ttl_s", 2 * settings["max_report_age_s"])
    # raises ValueError now, not on the first request
    kwargs: Dict[str, Any] = asdict(RouterSettings(**settings))
    return RequestRouterConfig(
        request_router_class=KVAwareRouter,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=stats_timeout_s or max(1.0, 2 * stats_period_s),
    )


def router_config(config: ServeConfig) -> RequestRouterConfig:
    """The group deployment's router: tpserve's KV-aware one, or one of Serve's to compare."""
    stats = dict(request_routing_stats_period_s=config.routing_stats_period_s,
                 request_routing_stats_timeout_s=max(1.0, config.routing_stats_period_s * 2))
    if config.router == "pow2":
        return RequestRouterConfig(**stats)
    if config.router in ("prefix_affinity", "round_robin"):
        from cluster.routing import baseline_routers

        cls = (baseline_routers.TokenPrefixAffinityRouter if config.router == "prefix_affinity"
               else baseline_routers.RoundRobinRouter)
        return RequestRouterConfig(request_router_class=cls, **stats)
    # The ingress hashes prompts at the engine's block size: the router counts blocks at it too.
    return kv_aware_router_config(stats_period_s=config.routing_stats_period_s,
                                  target_occupancy=config.kv_target_occupancy,
                                  block_size=config.engine.block_size)


def build_app(config: ServeConfig, cluster: Dict[str, float]):
    """The Serve application for ``config`` on a cluster with resources ``cluster``; its API
    key is read here, where the application is built."""
    api_key = resolve_api_key(config.api_key, config.api_key_file)
    engine = config.engine
    model_dir = resolve_model_path(engine.model)
    engine = EngineConfig(**{**engine.__dict__, "model": str(model_dir)})
    resources = group_resources(config, cluster)
    planned = planned_placement(config, cluster, resources)
    engine = rank_engine_config(engine, resources, planned)
    scaling: Dict = {"num_replicas": config.min_groups}
    if config.max_groups > config.min_groups:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=config.min_groups, max_replicas=config.max_groups,
            look_back_period_s=config.autoscale_look_back_s,
            metrics_interval_s=min(1.0, config.autoscale_look_back_s / 2),
            upscale_delay_s=config.upscale_delay_s, downscale_delay_s=config.downscale_delay_s,
            policy=AutoscalingPolicy(
                policy_function=KVLoadPolicy,
                policy_kwargs={"target_occupancy": config.kv_target_occupancy}))}
    per_group, queued, limits = request_limits(config)
    groups = serve.deployment(TPGroupServer).options(
        name="TPGroup",
        **group_placement_options(resources, engine.tp_size,
                                  config.placement_strategy or "PACK", planned),
        max_ongoing_requests=per_group,
        max_queued_requests=queued,
        backpressure_config=BackpressureConfig(status_code=429,
                                               retry_after_s=limits.retry_after_s),
        health_check_period_s=2.0,
        # Scale-down drains a group: Serve waits this long for its requests in flight.
        graceful_shutdown_timeout_s=120.0,
        request_router_config=router_config(config),
        **scaling,
    ).bind(engine, resources, planned)
    name = config.served_model_name or model_dir.name
    return build_ingress(groups, model_dir=str(model_dir), served_model_name=name,
                         block_size=engine.block_size,
                         max_model_len=served_context_length(engine, load_model_config(model_dir)),
                         api_key=api_key,
                         max_migrations=config.max_migrations,
                         limits=limits, replicas=ingress_replicas(config),
                         tool_call_parser=config.tool_call_parser)
