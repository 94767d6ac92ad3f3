"""The Serve application's configuration (``ServeConfig``) and where ``tpserve serve`` listens
(``ServePlan``): the one typed definition that `tpserve serve`'s options and a Serve config
file's args are generated from (``cluster.options``). Imports no Ray, so the CLI parses without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from cluster.api.tools.formats import PARSER_CHOICES
from workers.config import EngineConfig
from workers.option_field import option

ROUTERS = ("kv", "pow2", "prefix_affinity", "round_robin")
PLACEMENTS = ("auto", "plan", "serve")
# Ray's placement group strategies, for --placement-strategy (here: the CLI imports no Ray).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class ServeConfig:
    """The application: its engines, groups, router and limits; each ``option`` field is also
    a `tpserve serve` flag and a config file arg (``min_groups``/``max_groups``: ``--groups``)."""

    engine: EngineConfig
    min_groups: int = 1
    max_groups: int = 1
    kv_target_occupancy: float = option(
        0.70, "router's KV occupancy target per group (default 0.70)")
    api_key: Optional[str] = option(
        None, "require 'Authorization: Bearer KEY' (default $TPSERVE_API_KEY)",
        env="TPSERVE_API_KEY")
    # A file of keys, one per line, read where the app is built and re-read by each ingress
    # replica when it changes (cluster.api.api_key).
    api_key_file: Optional[str] = option(
        None, "require 'Authorization: Bearer KEY' for a KEY in this file (one per line), read "
              "where the app is built and re-read by every ingress replica when it changes "
              "(default $TPSERVE_API_KEY_FILE)", env="TPSERVE_API_KEY_FILE")
    served_model_name: Optional[str] = option(None, "model name in the API")
    routing_stats_period_s: float = 0.5
    # "kv": tpserve's KV-aware router;
    # baselines (cluster/routing/baseline_routers.py): "pow2" (Serve's default), "prefix_affinity",
    # "round_robin"
    router: str = "kv"
    max_migrations: int = option(  # re-sends of a request whose group failed while serving it
        3, "re-sends of a request to another group when its group fails while serving it (the "
           "stream continues; 0: fail it)")
    # "plan": the topology plan places each group (cluster.groups.allocator); "serve": Serve does;
    # "auto": the plan for a fixed number of groups on clusters with GPUs, else Serve.
    placement: str = option(
        "auto", "who places each TP group: the topology plan (probes every node) or Serve; auto: "
                "the plan on GPU clusters for a fixed --groups N, Serve for --groups MIN:MAX (its "
                "placement groups are demand Ray's autoscaler sees) (default)",
        choices=PLACEMENTS)
    # How Serve places each group's ranks (Ray's placement group strategy; --placement serve).
    # None: PACK, as Ray Serve LLM (one node where one has room, else spilling to others).
    placement_strategy: Optional[str] = option(
        None, "how Serve places a group's ranks (Ray's placement group strategy), where Serve "
              "places the groups: PACK (default, as Ray Serve LLM: one node where one has room, "
              "else across nodes), STRICT_PACK (one node, or wait), SPREAD, STRICT_SPREAD",
        choices=PLACEMENT_STRATEGIES)
    cpu_ranks_per_node: Optional[int] = None  # CPU plans: rank slots per node (None: its cores)
    # --groups MIN:MAX: KV usage averaged over the look-back window; Serve holds a decision this
    # long before acting on it (its defaults, 30 s up and 600 s down, ignore a full cache).
    autoscale_look_back_s: float = 5.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 30.0
    max_ongoing_requests: Optional[int] = None  # per group; None: from its KV capacity
    max_queued_requests: Optional[int] = option(  # per ingress
        None, "requests each ingress lets wait for a busy TP group; beyond them 429 with "
              "Retry-After (default: one more round of the groups' capacity)")
    max_request_body_mb: float = option(
        4.0, "largest request body in MiB; larger ones get 413 (default 4)")
    request_timeout_s: float = option(
        600.0, "a request still running after this is aborted with 504; a client may ask for "
               "less with X-Request-Timeout (default 600)")
    # OpenAI ingress replicas: "N", or "MIN:MAX" autoscaled on requests in flight. Each one
    # routes with its own router over the same group reports (cluster.routing.kv_router).
    ingress_replicas: str = option(
        "2:4", "OpenAI ingress replicas: N, or MIN:MAX autoscaled on requests in flight; each "
               "replica applies the request limits on its own (default 2:4)")
    # Chat templates sent in requests (Jinja run by the ingress): refused unless trusted.
    trust_request_chat_template: bool = option(
        False, "accept chat templates sent in requests (chat_template, "
               "chat_template_kwargs.chat_template): Jinja the ingress runs, bounded in time and "
               "size; without it they get 400")
    # The model's tool-call syntax, for requests with tools (cluster.api.tools.formats).
    tool_call_parser: str = option(
        "auto", "the model's tool-call format: llama3_json (Llama 3.x JSON), hermes (Hermes, "
                "Qwen2.5, Qwen3 <tool_call>), mistral ([TOOL_CALLS]); auto (default): from the "
                "chat template, and requests with tools get 400 when it shows none",
        choices=PARSER_CHOICES)

    def __post_init__(self) -> None:
        check_limits(self)
        ingress_replicas(self)
        if not 1 <= self.min_groups <= self.max_groups:
            raise ValueError(f"--groups must be N or MIN:MAX with 1 <= MIN <= MAX, got "
                             f"{self.min_groups}:{self.max_groups}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement must be auto, plan or serve, got {self.placement!r}")
        if self.placement_strategy is not None:
            check_placement_strategy(self.placement_strategy, self.placement)
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if not 0.0 < self.kv_target_occupancy <= 1.0:
            raise ValueError(f"--kv-target-occupancy must be in (0, 1], got "
                             f"{self.kv_target_occupancy}")


@dataclass(frozen=True)
class ServePlan:
    """What ``tpserve serve`` runs: the application's configuration and where it listens."""

    config: ServeConfig
    host: str = option("127.0.0.1", "HTTP host (default 127.0.0.1)")
    port: int = option(8000, "HTTP port (default 8000)")
    app_name: str = "tpserve"
    route_prefix: str = "/"
    grpc_options: Optional[Dict[str, Any]] = None  # the file's, for Serve's gRPC proxy

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}{self.route_prefix.rstrip('/')}/v1"


def check_placement_strategy(strategy: str, placement: str) -> None:
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"--placement-strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                         f"got {strategy!r}")
    if placement == "plan":
        raise ValueError("--placement-strategy places the ranks of groups Serve places; "
                         "--placement plan places them itself (by the topology probes)")


def check_limits(config: ServeConfig) -> None:
    """The request limits (``cluster.api.admission``, ``cluster.api.request_limits``)."""
    for name in ("max_ongoing_requests", "max_queued_requests"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer (requests), "
                             f"got {value!r}")
    if not 0 < config.max_request_body_mb < 1 << 20:
        raise ValueError(f"--max-request-body-mb must be a positive number of MiB, got "
                         f"{config.max_request_body_mb}")
    if not 0 < config.request_timeout_s < float("inf"):
        raise ValueError(f"--request-timeout-s must be a positive number of seconds, got "
                         f"{config.request_timeout_s}")


def parse_groups(text: str, flag: str = "--groups") -> Tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4); ``flag`` names the option in errors."""
    try:
        parts = [int(p) for p in text.split(":")]
    except (ValueError, AttributeError):
        raise ValueError(f"{flag} must be N or MIN:MAX, got {text!r}") from None
    if len(parts) not in (1, 2):
        raise ValueError(f"{flag} must be N or MIN:MAX, got {text!r}")
    return parts[0], parts[-1]


def ingress_replicas(config: ServeConfig) -> Tuple[int, int]:
    """``config.ingress_replicas`` as (MIN, MAX), 1 <= MIN <= MAX."""
    low, high = parse_groups(config.ingress_replicas, "--ingress-replicas")
    if not 1 <= low <= high:
        raise ValueError(f"--ingress-replicas must be N or MIN:MAX with 1 <= MIN <= MAX, got "
                         f"{config.ingress_replicas!r}")
    return low, high


def format_groups(min_groups: int, max_groups: int) -> str:
    """The ``--groups`` text of ``parse_groups``'s pair: ``"2"`` or ``"1:4"``."""
    return str(min_groups) if min_groups == max_groups else f"{min_groups}:{max_groups}"
