"""Group failures (what the "group replica restarting" alert watches) counted by the metrics store
and exported by the ingress's `/metrics` text."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from cluster.api import metrics as im
from cluster import metrics as m


def failures_in_text(text: bytes) -> dict:
    return {s.labels["cause"]: s.value for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == "tpserve:group_failures_total"}


def test_an_engine_reported_dead_after_alive_counts_once():
    store = m.MetricsStore()
    store.push("g1", {"engine_alive": 1.0})
    store.push("g1", {"engine_alive": 0.0})
    store.push("g1", {"engine_alive": 0.0})  # still dead: the same failure
    assert store.group_failures() == {"engine_died": 1, "lost": 0}


def test_a_group_stopping_on_purpose_is_no_failure():
    store = m.MetricsStore(stale_after_s=0.0)
    store.push("g1", {"engine_alive": 1.0})
    store.remove("g1")
    time.sleep(0.01)
    assert store.group_failures() == {"engine_died": 0, "lost": 0}
    assert store.snapshot() == {}


def test_a_live_group_that_stops_reporting_is_lost():
    store = m.MetricsStore(stale_after_s=0.05)
    store.push("alive", {"engine_alive": 1.0})
    store.push("dead", {"engine_alive": 1.0})
    store.push("dead", {"engine_alive": 0.0})  # counted as engine_died, not again as lost
    time.sleep(0.1)
    assert store.group_failures() == {"engine_died": 1, "lost": 1}
    assert store.snapshot() == {}


def test_failures_are_exported_even_at_zero():
    metrics = im.IngressMetrics("model", max_model_len=64)
    store = m.MetricsStore()
    assert failures_in_text(metrics.render({}, {}, store.group_failures())) == {
        "engine_died": 0.0, "lost": 0.0}
    store.push("g1", {"engine_alive": 1.0})
    store.push("g1", {"engine_alive": 0.0})
    assert failures_in_text(metrics.render(store.snapshot(), {}, store.group_failures()))[
        "engine_died"] == 1.0
    assert failures_in_text(metrics.render({}, {}, None)) == {}  # the store unreachable


def test_collective_errors_reach_the_text_as_a_counter():
    metrics = im.IngressMetrics("model", max_model_len=64)
    store = m.MetricsStore()
    store.push("g1", {"engine_alive": 1.0, "collective_errors_total": 2})
    text = metrics.render(store.snapshot(), {}).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["tpserve:collective_errors_total"] == 2.0
