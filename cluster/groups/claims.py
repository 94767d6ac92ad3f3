"""Which planned group a serving replica gets, on which device its ranks compute, and what
`tpserve status` shows: pure functions of plain inputs (no Ray), used by the allocator actor
(`cluster.groups.allocator`) and the status command.

    claim(plan_size, claims, replica, unavailable)
                                        -> the replica's group index, or None (the plan is full)
    compute_device(engine, plan_kind)   -> "cuda" or "cpu": explicit, never guessed from torch
    status_report(...)                  -> the JSON of `tpserve status`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence

from parallel.grouping import DeviceKind, PlacementPlan


@dataclass(frozen=True)
class Claim:
    """A planned group held by a serving replica since `since` (seconds, the allocator's clock)."""

    group: int
    replica: str
    since: float


def claim(plan_size: int, claims: Mapping[int, Claim], replica: str,
          unavailable: AbstractSet[int] = frozenset()) -> Optional[int]:
    """The group `replica` holds already, else the first planned group nobody holds and not
    `unavailable` (a rank's node has left the cluster); None when there is none (a replica
    beyond the plan)."""
    for index, held in claims.items():
        if held.replica == replica:
            return index
    return next((index for index in range(plan_size)
                 if index not in claims and index not in unavailable), None)


def beyond_plan_message(replica: str, plan: PlacementPlan, claims: Mapping[int, Claim]) -> str:
    return (f"replica {replica} has no planned group: the plan has {len(plan.groups)} group(s) of "
            f"TP {plan.tp_size} and replicas {sorted(c.replica for c in claims.values())} hold "
            f"them all; it is not placed anywhere else. Lower --groups MAX, or add nodes (they are "
            f"probed when a replica next asks)")


def compute_device(engine_device: str, plan_kind: DeviceKind) -> str:
    """The device the ranks of a planned group compute on. On a GPU plan `auto` means CUDA (a
    rank that then finds no CUDA fails, naming it: it never falls back to CPU silently); `cpu`
    runs the ranks on CPU while they still carry the plan's `CUDA_VISIBLE_DEVICES` (clusters whose
    GPUs are fake resources, and tests). A CPU plan computes on CPU."""
    if engine_device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {engine_device!r}")
    if plan_kind is DeviceKind.CPU:
        if engine_device == "cuda":
            raise ValueError("--device cuda, but the plan found no GPU on any node")
        return "cpu"
    return "cpu" if engine_device == "cpu" else "cuda"


def rank_torch_device(device: str) -> str:
    """What a rank passes to torch: its one visible GPU is `cuda:0` under the plan's
    `CUDA_VISIBLE_DEVICES`; `cpu` stays `cpu`."""
    return "cuda:0" if device.startswith("cuda") else "cpu"


def plan_summary(plan: Optional[PlacementPlan]) -> Optional[Dict[str, Any]]:
    """The plan as `tpserve status` shows it: groups of {node, device}, their links, why."""
    if plan is None:
        return None
    data = plan.to_dict()
    data["links"] = [{"link": None if g.link is None else str(g.link),
                      "fabric_gbps": g.fabric_gbps, "spans_nodes": g.spans_nodes}
                     for g in plan.groups]
    return data


def status_report(plan: Optional[Dict[str, Any]], claims: Sequence[Dict[str, Any]],
                  refusals: Sequence[Dict[str, Any]], groups: Mapping[str, Dict[str, Any]],
                  deployment: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """`tpserve status --json`. `groups[replica]`: what the replica registered (`ranks`, each
    `{node, device, pid, ...}`, and `planned_group`) merged with its latest metrics (`kv_usage`,
    `running`, `waiting`); `claims` and `refusals` come from the allocator (empty when Serve
    places the groups itself, as on CPU-only clusters)."""
    held = {claim["group"] for claim in claims}
    live = []
    for replica in sorted(groups):
        info = groups[replica]
        live.append({"replica": replica, "planned_group": info.get("planned_group"),
                     "ranks": list(info.get("ranks", [])), "kv_usage": info.get("kv_usage"),
                     "running": info.get("running"), "waiting": info.get("waiting")})
    num_planned = len(plan["groups"]) if plan else 0
    return {
        "placement": "plan" if plan else "serve",
        "plan": plan,
        "groups": live,
        "claims": list(claims),
        "unclaimed_groups": [k for k in range(num_planned) if k not in held],
        "errors": [refusal["message"] for refusal in refusals],
        "deployment": deployment,
    }


def render_status(report: Mapping[str, Any]) -> str:
    """The human form of `status_report`."""
    lines: List[str] = []
    plan = report["plan"]
    if plan is None:
        lines.append("placement: Serve places each group (no topology plan: CPU-only cluster)")
    else:
        lines.append(f"plan: {len(plan['groups'])} group(s) of TP {plan['tp']} "
                     f"({plan['device_kind']})")
        lines += [f"  {line}" for line in plan["explanation"]]
        lines.append(f"unclaimed planned groups: {report['unclaimed_groups']}")
    deployment = report.get("deployment") or {}
    if deployment:
        lines.append(f"deployment: {deployment.get('status')} "
                     f"{deployment.get('message') or ''}".rstrip())
    for group in report["groups"]:
        planned = group["planned_group"]
        kv = group["kv_usage"]
        lines.append(f"replica {group['replica']}"
                     + (f" (planned group {planned})" if planned is not None else "")
                     + f": kv {'?' if kv is None else f'{kv:.0%}'}, running {group['running']}, "
                     f"waiting {group['waiting']}")
        for k, rank in enumerate(group["ranks"]):
            lines.append(f"  rank {k}: node {rank.get('node')} device {rank.get('device')} "
                         f"pid {rank.get('pid')}")
    lines += [f"error: {message}" for message in report["errors"]]
    return "\n".join(lines)
