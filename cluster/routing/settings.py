"""The KV-aware router's settings (its ``request_router_kwargs``), validated: a bad value raises
ValueError naming it when the deployment is configured, not on the first request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cluster.routing.ranking import (
    DEFAULT_LOAD_WEIGHT,
    DEFAULT_MAX_REPORT_AGE_S,
    DEFAULT_PREFIX_WEIGHT,
    DEFAULT_TARGET_OCCUPANCY,
)


@dataclass(frozen=True)
class RouterSettings:
    """``request_router_kwargs`` of `cluster.routing.kv_router.KVAwareRouter`, checked on construction
    (see `cluster.app.kv_aware_router_config`)."""

    target_occupancy: float = DEFAULT_TARGET_OCCUPANCY
    max_report_age_s: float = DEFAULT_MAX_REPORT_AGE_S
    charge_ttl_s: float = 2 * DEFAULT_MAX_REPORT_AGE_S
    # The router's block size (the engine's, set by `cluster.app`); None: the groups' reported one.
    block_size: Optional[int] = None
    num_decision_times: int = 4096
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    load_weight: float = DEFAULT_LOAD_WEIGHT

    def __post_init__(self) -> None:
        if not 0.0 < self.target_occupancy <= 1.0:
            raise ValueError(
                f"target_occupancy must be in (0, 1] (a fraction of the KV pool), "
                f"got {self.target_occupancy}"
            )
        if not self.max_report_age_s > 0:
            raise ValueError(f"max_report_age_s must be positive, got {self.max_report_age_s}")
        if not self.charge_ttl_s > 0:
            raise ValueError(f"charge_ttl_s must be positive, got {self.charge_ttl_s}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_decision_times < 1:
            raise ValueError(f"num_decision_times must be >= 1, got {self.num_decision_times}")
        if not (self.prefix_weight >= 0 and self.load_weight >= 0):
            raise ValueError(f"prefix_weight and load_weight must not be negative, got "
                             f"{self.prefix_weight} and {self.load_weight}")
