"""The alert rules under Prometheus's own ``promtool``: ``check rules`` on the plain file and on
the chart's rendering for another release, ``test rules`` on deploy/prometheus/tests/ (for every
alert, series that must fire it and series that must not), ``check config`` on the plain scrape
config; and the job ``TPServeDown`` watches is the one both scrape setups give tpserve.

``promtool`` comes with the Debian package ``prometheus``. Without it these tests skip, except
under CI (``CI`` set), where .ci/run installs it and its absence fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest
import yaml

from monitoring import ALERT_TESTS, ALERTS, SCRAPE_CONFIG, alert_exprs, read_alerts


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: install the Debian package prometheus " \
                  "(apt-get install --no-install-recommends prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message + "; under CI, .ci/run installs it")
        pytest.skip(message)
    return path


def run(*args: str) -> str:
    done = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def watched_job(rules) -> str:
    (job,) = re.findall(r'absent\(up\{job="([^"]+)"\}', alert_exprs(rules)["TPServeDown"])
    return job


def test_the_rules_pass_promtools_check_and_unit_tests():
    run("check", "rules", str(ALERTS))
    assert ALERT_TESTS
    out = run("test", "rules", *map(str, ALERT_TESTS))
    assert "SUCCESS" in out


def test_the_plain_scrape_config_loads_the_rules_and_scrapes_the_watched_job():
    run("check", "config", str(SCRAPE_CONFIG))
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert config["rule_files"] == [ALERTS.name]
    assert [job["job_name"] for job in config["scrape_configs"]] == [watched_job(read_alerts())]


def test_the_charts_rules_check_and_watch_its_podmonitors_job(tmp_path: Path):
    helm = pytest.importorskip("helm_python")
    chart = Path(__file__).resolve().parents[2] / "helm" / "tpserve"
    values = {"monitoring": {"prometheusRule": {"enabled": True}, "podMonitor": {"enabled": True}}}
    with helm.Chart.load(str(chart)) as loaded:
        manifests = loaded.render(values, name="prod", namespace="llm")
    docs = [d for text in manifests.values() for d in yaml.safe_load_all(text) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    run("check", "rules", str(path))
    jobs = [r["replacement"] for d in docs if d["kind"] == "PodMonitor"
            for e in d["spec"]["podMetricsEndpoints"] if e.get("path") == "/metrics"
            for r in e.get("relabelings", []) if r.get("targetLabel") == "job"]
    assert jobs == [watched_job(rule["spec"])] == ["prod-tpserve"]


def cases(alert: str) -> List[bool]:
    """For each unit-test case of ``alert``: whether it expects the alert to fire."""
    found = []
    for path in ALERT_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                if case["alertname"] == alert:
                    found.append(bool(case["exp_alerts"]))
    return found


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not():
    for alert in alert_exprs(read_alerts()):
        assert set(cases(alert)) == {True, False}, alert
