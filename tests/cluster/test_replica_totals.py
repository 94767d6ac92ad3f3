"""Every ingress replica's numbers summed for /metrics (cluster.api.replica_totals), without Ray:
the same totals whichever replica answers, and totals that never go down when a replica stops."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api.replica_totals import (ReplicaSnapshot, ReplicaTotals, as_metrics,
                                        family_snapshots)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Replica:
    """A registry like an ingress replica's: a counter, a gauge and a histogram."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.registry = CollectorRegistry()
        self.requests = Counter("t:requests", "requests", ["model_name"], registry=self.registry)
        self.in_flight = Gauge("t:in_flight", "in flight", registry=self.registry)
        self.latency = Histogram("t:latency_seconds", "latency", buckets=(0.1, 1.0),
                                 registry=self.registry)

    def snapshot(self) -> ReplicaSnapshot:
        return ReplicaSnapshot(self.name, family_snapshots(self.registry.collect()))


def values(totals: ReplicaTotals) -> dict:
    """{(sample name, labels): value} of the totals' Prometheus text, parsed back."""
    registry = CollectorRegistry()
    families = as_metrics(totals.families())

    class Collector:
        def collect(self):
            return families

    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_counters_histograms_and_gauges_add_up_over_replicas():
    a, b = Replica("a"), Replica("b")
    a.requests.labels("m").inc(3)
    b.requests.labels("m").inc(4)
    a.in_flight.set(2)
    b.in_flight.set(5)
    a.latency.observe(0.05)
    b.latency.observe(0.5)
    totals = ReplicaTotals(clock=Clock())
    totals.push(a.snapshot())
    totals.push(b.snapshot())
    got = values(totals)
    assert got[("t:requests_total", (("model_name", "m"),))] == 7
    assert got[("t:in_flight", ())] == 7
    assert got[("t:latency_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("t:latency_seconds_bucket", (("le", "1.0"),))] == 2
    assert got[("t:latency_seconds_count", ())] == 2
    assert abs(got[("t:latency_seconds_sum", ())] - 0.55) < 1e-9


def test_a_replica_pushing_again_replaces_its_numbers():
    a = Replica("a")
    totals = ReplicaTotals(clock=Clock())
    a.requests.labels("m").inc(1)
    totals.push(a.snapshot())
    a.requests.labels("m").inc(1)
    totals.push(a.snapshot())
    assert values(totals)[("t:requests_total", (("model_name", "m"),))] == 2


def test_a_stopped_replica_keeps_its_totals_but_not_its_gauges():
    clock = Clock()
    a, b = Replica("a"), Replica("b")
    a.requests.labels("m").inc(5)
    a.in_flight.set(3)
    b.in_flight.set(1)
    totals = ReplicaTotals(stale_after_s=30, clock=clock)
    totals.push(a.snapshot())
    clock.now += 31
    totals.push(b.snapshot())
    got = values(totals)
    assert got[("t:requests_total", (("model_name", "m"),))] == 5
    assert got[("t:in_flight", ())] == 1


def test_replicas_past_the_bound_fold_into_a_retired_total():
    clock = Clock()
    totals = ReplicaTotals(stale_after_s=10, max_replicas=2, clock=clock)
    for i in range(5):
        replica = Replica(f"r{i}")
        replica.requests.labels("m").inc(i + 1)
        replica.in_flight.set(1)
        totals.push(replica.snapshot())
        clock.now += 11  # each one stops reporting before the next starts
    assert len(totals.replica_ids()) == 2
    got = values(totals)
    assert got[("t:requests_total", (("model_name", "m"),))] == 1 + 2 + 3 + 4 + 5
    assert ("t:in_flight", ()) not in got or got[("t:in_flight", ())] == 0


def test_live_replicas_are_never_folded():
    clock = Clock()
    totals = ReplicaTotals(stale_after_s=10, max_replicas=2, clock=clock)
    for i in range(3):
        totals.push(Replica(f"r{i}").snapshot())
    assert totals.replica_ids() == ["r0", "r1", "r2"]
