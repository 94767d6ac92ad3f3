"""The ingress's request metrics: time to first token, inter-token and end-to-end latency, token
counts and finish reasons in its own Prometheus registry (``IngressMetrics``), timed per request by
``RequestTimer``, with its requests in flight against its limit (`cluster.api.admission`) and its
routers' decisions. ``IngressMetrics.render`` makes the ``/metrics`` text from every ingress
replica's numbers summed (`cluster.api.replica_totals`) and the groups' from the metrics store
(`cluster.metrics`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.metrics import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    PREFIX,
    TTFT_BUCKETS,
    GroupRecord,
    RayMetricsMirror,
    group_metric_families,
)
from cluster.api.replica_totals import (
    FamilySnapshot,
    ReplicaSnapshot,
    as_metrics,
    family_snapshots,
)


@dataclass
class RequestTimer:
    """Times one request as its stream arrives: first token, gaps between tokens, end."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    inter_token_s: List[float] = field(default_factory=list)

    def on_tokens(self, num_new_tokens: int, now: Optional[float] = None) -> None:
        if num_new_tokens <= 0:
            return
        now = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token_s.append(now - self.last_token)
        self.last_token = now

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass(frozen=True)
class _HistogramSpec:
    metric: Histogram
    name: str
    buckets: Tuple[float, ...]


class IngressMetrics:
    """The ingress's own registry (never the process-global one) and its ``/metrics`` text."""

    def __init__(self, model_name: str, max_model_len: int, export_to_ray: bool = False) -> None:
        # The ``*_created`` series only add noise to a scrape (vLLM turns them off too); this is
        # process-wide, and the replica's process exports nothing else through the client.
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        token_buckets = _one_two_five_buckets(max_model_len)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between tokens",
                                   ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency",
                                   E2E_BUCKETS)
        self.prompt_tokens_hist = self._histogram("request_prompt_tokens",
                                                  "Prompt tokens per request", token_buckets)
        self.generation_tokens_hist = self._histogram(
            "request_generation_tokens", "Generated tokens per request", token_buckets)
        lbl, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens", lbl, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", lbl,
                                         registry=reg)
        self.success = Counter(PREFIX + "request_success", "Finished requests by reason",
                               lbl + ["finished_reason"], registry=reg)
        self.migrations = Counter(PREFIX + "request_migrations",
                                  "Requests sent again to another group after theirs failed",
                                  lbl + ["reason"], registry=reg)
        self.grpc_requests = Counter(PREFIX + "grpc_requests", "gRPC calls by method and status",
                                     lbl + ["method", "code"], registry=reg)
        self._mirror = RayMetricsMirror() if export_to_ray else None
        self._admission: Optional[_Admission] = None

    def track_admission(self, admission: "_Admission") -> None:
        """Export ``admission``'s requests in flight and its limit with every render."""
        self._admission = admission

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> _HistogramSpec:
        metric = Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                           buckets=buckets)
        return _HistogramSpec(metric, PREFIX + name, tuple(buckets))

    def record(self, timer: RequestTimer, num_prompt_tokens: int, num_generation_tokens: int,
               finished_reason: str, now: Optional[float] = None) -> None:
        """One request ended (``finished_reason``: stop, length, abort or error)."""
        now = time.perf_counter() if now is None else now
        name = self.model_name
        observations = [(self.e2e, now - timer.arrival),
                        (self.prompt_tokens_hist, num_prompt_tokens),
                        (self.generation_tokens_hist, num_generation_tokens)]
        if timer.ttft_s is not None:
            observations.append((self.ttft, timer.ttft_s))
        observations.extend((self.itl, gap) for gap in timer.inter_token_s)
        for spec, value in observations:
            spec.metric.labels(name).observe(value)
        self.prompt_tokens.labels(name).inc(num_prompt_tokens)
        self.generation_tokens.labels(name).inc(num_generation_tokens)
        self.success.labels(name, finished_reason).inc()
        if self._mirror is not None:
            self._mirror.request(name, observations, finished_reason, num_prompt_tokens,
                                 num_generation_tokens)

    def record_migration(self, reason: str) -> None:
        """A request went to another group (``reason``: engine_dead, actor_died, ...)."""
        self.migrations.labels(self.model_name, reason).inc()
        if self._mirror is not None:
            self._mirror.counter(PREFIX + "request_migrations", 1,
                                 {"model_name": self.model_name, "reason": reason})

    def record_grpc(self, method: str, code: str) -> None:
        """One gRPC call ended with status ``code`` (OK, INVALID_ARGUMENT, CANCELLED, ...); its
        request, if it reached a group, is also in the histograms and ``request_success``."""
        tags = {"model_name": self.model_name, "method": method, "code": code}
        self.grpc_requests.labels(**tags).inc()
        if self._mirror is not None:
            self._mirror.counter(PREFIX + "grpc_requests", 1, tags)

    def replica_snapshot(self, replica_id: str,
                         router_counts: Mapping[str, int]) -> ReplicaSnapshot:
        """This replica's own numbers (its registry, its routers' decisions), to be summed with
        the other replicas' (`cluster.api.replica_totals`)."""
        decisions = CounterMetricFamily(PREFIX + "router_decisions",
                                        "RankedGroup decisions by reason", labels=["reason"])
        for reason, n in sorted(router_counts.items()):
            decisions.add_metric([reason], n)
        admission = (self._admission_families(self._admission)
                     if self._admission is not None else [])
        return ReplicaSnapshot(replica_id, family_snapshots(
            [*self.registry.collect(), *admission, decisions]))

    def render(self, groups: Mapping[str, GroupRecord], router_counts: Mapping[str, int],
               group_failures: Optional[Mapping[str, int]] = None,
               replicas: Optional[Sequence[FamilySnapshot]] = None) -> bytes:
        """The Prometheus text of the ingress replicas (``replicas``: every replica's numbers
        summed; None: this replica's own, with ``router_counts``, as when the store cannot be
        reached), every group, and the group failures (``MetricsStore.group_failures``; None
        when the store could not be reached)."""
        if replicas is None:
            replicas = self.replica_snapshot("", router_counts).families
        families = as_metrics(replicas) + group_metric_families(groups, self.model_name)
        if group_failures is not None:
            failures = CounterMetricFamily(
                PREFIX + "group_failures", "TP group failures (Serve restarts the replica)",
                labels=["model_name", "cause"])
            for cause, n in sorted(group_failures.items()):
                failures.add_metric([self.model_name, cause], n)
            families.append(failures)
        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(_Families(families))
        return generate_latest(scrape)

    def _admission_families(self, admission: "_Admission") -> List[Metric]:
        out = []
        for name, doc, value in (
                ("ingress_requests_in_flight", "Generation requests the ingress replicas hold",
                 admission.num_in_flight),
                ("ingress_max_requests_in_flight",
                 "The limit on them, summed over the replicas (429 beyond it)",
                 admission.max_in_flight)):
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            out.append(family)
        return out


class _Admission(Protocol):
    """What is read of ``cluster.api.admission.IngressAdmission``."""

    num_in_flight: int
    max_in_flight: int


def _one_two_five_buckets(limit: int) -> Tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(float(b) for b in out)
            out.append(m * scale)
        scale *= 10


class _Families:
    """A collector that yields families built elsewhere (for a one-off registry)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families
