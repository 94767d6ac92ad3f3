"""Autoscaling TP groups on KV load (``--groups MIN:MAX``).

Each group replica reports ``kv_usage`` (fraction of its device KV blocks in use) through Serve's
``record_autoscaling_stats``; Serve aggregates it per replica over its look-back window and calls
the policy. The policy wants enough groups that the mean usage sits at the router's occupancy
target: ``ceil(sum(usage) / target)``, within [MIN, MAX]. It scales up at once (a full cache
preempts and recomputes) and down only after ``downscale_after`` consecutive decisions agree,
then keeps asking for fewer while the load stays low; Serve then holds the decision for the
deployment's ``downscale_delay_s`` (``ServeConfig``), so a short lull does not tear down a group
and its warm prefix cache. Scale-down drains: Serve stops routing to the group and waits for its
requests in flight (``graceful_shutdown_timeout_s``) before the replica stops.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence, Tuple

KV_USAGE_METRIC = "kv_usage"


def desired_groups(usages: Sequence[float], num_current: int, min_groups: int, max_groups: int,
                   target: float) -> int:
    """Groups needed so that the load spread over them sits at ``target`` occupancy."""
    if not usages:
        return max(min_groups, min(num_current, max_groups))
    needed = math.ceil(round(sum(usages) / target, 6))
    return max(min_groups, min(max_groups, max(needed, 1)))


class KVLoadPolicy:
    """Serve autoscaling policy (``AutoscalingPolicy(policy_function=KVLoadPolicy, ...)``)."""

    def __init__(self, target_occupancy: float = 0.70, downscale_after: int = 3) -> None:
        self.target = target_occupancy
        self.downscale_after = downscale_after

    def __call__(self, ctx) -> Tuple[int, Dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        metrics = (ctx.aggregated_metrics or {}).get(KV_USAGE_METRIC, {})
        current = ctx.current_num_replicas
        wanted = desired_groups(list(metrics.values()), current,
                                ctx.capacity_adjusted_min_replicas,
                                ctx.capacity_adjusted_max_replicas, self.target)
        if wanted >= current:
            state["low_streak"] = 0
            return wanted, state
        state["low_streak"] = state.get("low_streak", 0) + 1
        if state["low_streak"] < self.downscale_after:
            return current, state
        # Keep asking while the load stays low: Serve acts on a decision only after it held
        # for downscale_delay_s, so going back to `current` here would restart its clock.
        return wanted, state
