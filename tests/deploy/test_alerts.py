"""deploy/prometheus/alerts.yaml is the chart's PrometheusRule with the default thresholds (one
source: helm/tpserve/templates/_alerts.tpl), every rule and dashboard query is valid PromQL, and
the rules are the ones the incident asked for. That each metric they name is exported is checked
against a live endpoint in test_deploy_serve_run.py."""

from __future__ import annotations


import pytest

from monitoring import (ALERTS, DASHBOARD, PROMETHEUS_SERIES, REPO, alert_exprs,
                        dashboard_exprs, metric_names, read_alerts, read_dashboard)

pytest.importorskip("helm_python")
pytest.importorskip("promql_parser")


def render_alerts_module():
    from scripts import render_alerts
    return render_alerts


def test_the_plain_rules_file_is_the_charts_rule_rendered_with_defaults():
    script = render_alerts_module()
    assert read_alerts() == script.rendered_rules()
    assert ALERTS.read_text() == script.alerts_text()
    assert script.main(["--check"]) == 0


def test_thresholds_follow_the_values():
    rules = render_alerts_module().rendered_rules(
        {"alerts": {"ttftP99Seconds": 0.75, "allReduceP99Seconds": 0.02, "kvUsage": 0.9,
                    "gpuMemory": 0.95, "kvTierFill": 0.7, "ingressInFlight": 0.6}})
    exprs = alert_exprs(rules)
    assert exprs["TPServeTTFTHigh"].endswith("> 0.75")
    assert exprs["TPServeAllReduceSlow"].endswith("> 0.02")
    assert exprs["TPServeKVCacheFull"].endswith("> 0.9")
    assert exprs["TPServeGPUMemoryHigh"].endswith("> 0.95")
    assert exprs["TPServeKVHostTierFull"].endswith("> 0.7")
    assert exprs["TPServeKVDiskTierFull"].endswith("> 0.7")
    assert exprs["TPServeIngressNearLimit"].endswith("> 0.6")


def test_the_incidents_alerts_with_their_thresholds():
    rules = {r["alert"]: r for g in read_alerts()["groups"] for r in g["rules"]}
    expected = {  # alert -> (metrics, threshold at the end of the expression, for)
        "TPServeDown": ({"up"}, "== 1)", "2m"),
        "TPServeCollectiveErrors": ("tpserve:collective_errors_total", "> 0", None),
        "TPServeAllReduceSlow": ("tpserve:allreduce_latency_seconds_bucket", "> 0.05", "5m"),
        "TPServeKVCacheFull": ("tpserve:kv_cache_usage_perc", "> 0.8", "5m"),
        "TPServeGPUMemoryHigh": ({"tpserve:gpu_memory_used_bytes",
                                  "tpserve:gpu_memory_total_bytes"}, "> 0.8", "5m"),
        "TPServeKVHostTierFull": ({"tpserve:kv_tier_host_blocks_used",
                                   "tpserve:kv_tier_host_blocks_total"}, "> 0.8", "15m"),
        "TPServeKVDiskTierFull": ({"tpserve:kv_tier_disk_blocks_used",
                                   "tpserve:kv_tier_disk_blocks_total"}, "> 0.8", "15m"),
        "TPServeIngressNearLimit": ({"tpserve:ingress_requests_in_flight",
                                     "tpserve:ingress_max_requests_in_flight"}, "> 0.8", "5m"),
        "TPServeKVTierChecksumFailures": ("tpserve:kv_tier_checksum_failures_total", "> 0", None),
        "TPServeKVTierIOErrors": ("tpserve:kv_tier_io_errors_total", "> 0", None),
        "TPServeTTFTHigh": ("tpserve:time_to_first_token_seconds_bucket", "> 2", "10m"),
        "TPServeGroupRestarting": ("tpserve:group_failures_total", "> 0", None),
    }
    assert set(rules) == set(expected)
    for name, (metrics, threshold, duration) in expected.items():
        rule = rules[name]
        assert metric_names(rule["expr"]) == (
            metrics if isinstance(metrics, set) else {metrics}), name
        assert " ".join(rule["expr"].split()).endswith(threshold), name
        assert rule.get("for") == duration, name
        assert rule["labels"]["severity"] in ("warning", "critical")
        if name != "TPServeDown":  # absent() has no labels to name
            assert "{{ $labels." in rule["annotations"]["summary"]  # Prometheus's, not Helm's


def test_every_query_is_valid_promql_on_tpserve_metrics():
    exprs = list(alert_exprs(read_alerts()).values()) + list(dashboard_exprs(read_dashboard()))
    assert len(exprs) >= 15
    for expr in exprs:
        names = metric_names(expr) - PROMETHEUS_SERIES  # raises on a syntax error
        assert names or "absent(up{" in expr, expr
        assert all(n.startswith("tpserve:") for n in names), expr
    with pytest.raises(ValueError):
        metric_names("rate(tpserve:collective_errors_total[5m)")


def test_dashboard_is_one_file_for_grafana_and_the_chart():
    dashboard = read_dashboard()
    assert dashboard["uid"] == "tpserve" and dashboard["panels"]
    assert DASHBOARD.resolve() == (REPO / "helm" / "tpserve" / "files" / "tpserve.json").resolve()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
