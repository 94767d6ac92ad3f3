"""`tpserve status [--address ADDR] [--json]`: the topology plan, every live group replica (its
ranks' node, device and process, KV usage, requests running and waiting), unclaimed planned
groups, and replicas the plan could not place."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, Optional

APP_NAME = "tpserve"
GROUP_DEPLOYMENT = "TPGroup"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="the plan and the live TP groups of a cluster")
    parser.add_argument("--address", default="auto",
                        help="the Ray cluster serving tpserve (default: auto, the local one)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    try:
        report = collect_status()
    finally:
        ray.shutdown()
    from cluster.groups.claims import render_status

    print(json.dumps(report, indent=2) if args.json else render_status(report))
    if report["deployment"] is None and not report["groups"]:
        print("tpserve status: no tpserve application on this cluster", file=sys.stderr)
        return 1
    return 0


def collect_status() -> Dict[str, Any]:
    """Ask the allocator (plan, claims, refusals), the metrics store (live groups) and Serve."""
    import ray

    from cluster.groups.allocator import get_group_allocator
    from cluster.groups.claims import status_report
    from cluster.metrics import METRICS_NAMESPACE, METRICS_STORE_NAME

    allocator: Dict[str, Any] = {"plan": None, "claims": [], "refusals": []}
    try:
        allocator = ray.get(get_group_allocator().status.remote(), timeout=60)
    except ValueError:
        pass  # no allocator: Serve places the groups (CPU-only cluster)
    groups: Dict[str, Dict[str, Any]] = {}
    try:
        store = ray.get_actor(METRICS_STORE_NAME, namespace=METRICS_NAMESPACE)
        records, described = ray.get([store.snapshot.remote(), store.descriptions.remote()],
                                     timeout=30)
        for replica, record in records.items():
            values = record.values
            groups[replica] = {**described.get(replica, {}),
                               "kv_usage": values.get("kv_usage_frac"),
                               "running": _int(values.get("num_requests_running")),
                               "waiting": _int(values.get("num_requests_waiting"))}
    except ValueError:
        pass  # no group has reported yet
    return status_report(allocator["plan"], allocator["claims"], allocator["refusals"], groups,
                         _deployment_status())


def _int(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)


def _deployment_status() -> Optional[Dict[str, Any]]:
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - Serve not running on this cluster
        return None
    if app is None or GROUP_DEPLOYMENT not in app.deployments:
        return None
    deployment = app.deployments[GROUP_DEPLOYMENT]
    return {"status": str(deployment.status.value if hasattr(deployment.status, "value")
                          else deployment.status),
            "message": deployment.message,
            "replica_states": {str(k): v for k, v in deployment.replica_states.items()}}
