"""The metric names that the alert rules and the Grafana dashboard query, read with a real
PromQL parser (``promql-parser``), and the names a ``/metrics`` scrape exposes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterator, Set

import yaml

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "tpserve.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERT_TESTS = sorted((REPO / "deploy" / "prometheus" / "tests").glob("*.yaml"))
# Queried but not from tpserve's /metrics: Prometheus's own per-target series.
PROMETHEUS_SERIES = {"up"}
# Exported by ranks on a GPU only (workers/device_memory.py).
GPU_ONLY = {"tpserve:gpu_memory_used_bytes", "tpserve:gpu_memory_total_bytes"}


def metric_names(expr: str) -> Set[str]:
    """Every metric name a PromQL expression selects (``ValueError`` if it does not parse)."""
    import promql_parser

    names: Set[str] = set()

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def alert_exprs(rules: Dict) -> Dict[str, str]:
    """``alert name -> expr`` of a Prometheus rules document (``groups: [{rules: [...]}]``)."""
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]
            if "alert" in rule}


def dashboard_exprs(dashboard: Dict) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


def read_alerts() -> Dict:
    return yaml.safe_load(ALERTS.read_text())


def read_dashboard() -> Dict:
    return json.loads(DASHBOARD.read_text())


def scraped_names(text: str) -> Set[str]:
    """The sample names of a Prometheus text scrape (``x_bucket``, ``x_total``, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name for family in text_string_to_metric_families(text)
            for sample in family.samples}
