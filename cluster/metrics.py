"""Serving metrics: the groups' store, the ingress's request histograms, Prometheus text.

Each TP group pushes a snapshot of its numbers about once a second to one named actor
(``MetricsStoreActor``, a one-line Ray wrapper of the plain ``MetricsStore``); the ingress
measures what only it sees (time to first token, inter-token and end-to-end latency, token
counts) in its own ``IngressMetrics`` (`cluster.api.metrics`). ``/metrics`` renders both,
plus the router's decision counts, in the Prometheus text format, under vLLM's metric names
with the prefix ``tpserve:`` (``vllm:kv_cache_usage_perc`` -> ``tpserve:kv_cache_usage_perc``).
Each ingress replica also pushes its own numbers to the store, which sums them
(`cluster.api.replica_totals`), so ``/metrics`` is the same whichever replica answers.

The same numbers go to Ray's own metrics export through ``ray.util.metrics``. Ray 2.60 warns
about ``:`` in names, so there they are ``tpserve_*``, and Ray's exporter prefixes ``ray_``:
``ray_tpserve_time_to_first_token_seconds`` (one series per process).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import ray
from ray.util import metrics as ray_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from cluster.api.replica_totals import FamilySnapshot, ReplicaSnapshot, ReplicaTotals

logger = logging.getLogger(__name__)

PREFIX = "tpserve:"
METRICS_STORE_NAME = "tpserve-metrics"
METRICS_NAMESPACE = "tpserve"

# vLLM's buckets for the request latencies (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Collectives: from 10 us (a small all-reduce on one host) to a second (a stalled peer).
COLLECTIVE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                      5e-2, 0.1, 0.25, 0.5, 1.0)

GROUP_FAILURE_CAUSES = ("engine_died", "lost")

# Snapshot keys with a vLLM counterpart: key -> (name without prefix, kind). Other numeric keys
# (the KV tiers' among them) are exported by their own name: a counter when they end in
# ``_total``, else a gauge; list-valued keys are samples for a histogram.
GROUP_METRICS: Dict[str, Tuple[str, str]] = {
    "kv_usage_frac": ("kv_cache_usage_perc", "gauge"),
    "num_requests_running": ("num_requests_running", "gauge"),
    "num_requests_waiting": ("num_requests_waiting", "gauge"),
    "tokens_in_flight": ("tokens_in_flight", "gauge"),
    "kv_blocks_used": ("num_kv_blocks_used", "gauge"),
    "kv_blocks_total": ("num_kv_blocks", "gauge"),  # capacity, not a counter
    "prefix_cache_queries_total": ("prefix_cache_queries", "counter"),
    "prefix_cache_hits_total": ("prefix_cache_hits", "counter"),
    "num_preemptions_total": ("num_preemptions", "counter"),
}

# Snapshot keys whose value is a mapping {label value: number}, one series per label value:
# key -> the label's name (named and typed like the other keys).
LABELLED_GROUP_METRICS: Dict[str, str] = {
    "kv_tier_disk_dir_written_bytes_total": "dir",  # per --disk-kv-dir entry
    "kv_tier_disk_dir_read_bytes_total": "dir",
    "collective_errors_total": "kind",  # error, timeout, hang (parallel.collective_errors)
    "gpu_memory_used_bytes": "rank",  # per rank of the group (workers.device_memory)
    "gpu_memory_total_bytes": "rank",
    "gpu_memory_reserved_bytes": "rank",
}

# The help text of the series whose meaning the name does not say; others read "TP group <key>".
GROUP_METRIC_HELP: Dict[str, str] = {
    "allreduce_latency_seconds": (
        "All-reduce latency on the device group: on CPU (gloo) every call, timed on the host; "
        "on CUDA a sample of calls, eager or inside CUDA-graph replays, each timed by a pair of "
        "CUDA events around the collective alone (waiting for the slowest rank included)"),
    "collective_errors_total": (
        "Failed collectives, summed over the group's ranks, by kind: error (a collective "
        "raised), timeout (gloo or NCCL gave up waiting), hang (the step watchdog declared a "
        "step hung)"),
    "gpu_memory_used_bytes": "GPU memory in use on a rank's device (total - free, every process)",
    "gpu_memory_total_bytes": "GPU memory of a rank's device",
    "gpu_memory_reserved_bytes": "GPU memory held by PyTorch's caching allocator on a rank",
}


def _help(key: str) -> str:
    return GROUP_METRIC_HELP.get(key, f"TP group {key}")


def group_metric_kind(key: str) -> Tuple[str, str]:
    """``(full metric name, gauge|counter)`` of a numeric snapshot key."""
    if key in GROUP_METRICS:
        name, kind = GROUP_METRICS[key]
        return PREFIX + name, kind
    if key.endswith("_total"):
        return PREFIX + key[:-len("_total")], "counter"
    return PREFIX + key, "gauge"


def _is_metric_key(key: Any) -> bool:
    return isinstance(key, str) and key.isidentifier() and key.isascii()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# ----- histograms held as plain data (for the store, which must be picklable) -----


@dataclass
class HistogramState:
    """Bucket counts of a histogram. ``counts[i]``: samples in ``(bounds[i-1], bounds[i]]``;
    the last entry counts those above every bound."""

    bounds: Tuple[float, ...]
    counts: List[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative_buckets(self) -> List[Tuple[str, int]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, as Prometheus wants them."""
        out, running = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


# ----- the groups' store -----


@dataclass
class GroupRecord:
    pushed_at: float
    values: Dict[str, float]
    histograms: Dict[str, HistogramState]
    labelled: Dict[str, Dict[str, float]] = field(default_factory=dict)  # LABELLED_GROUP_METRICS


class MetricsStore:
    """The latest snapshot of each TP group, and its histogram samples accumulated.

    A group that has not pushed for ``stale_after_s`` (its replica died or was replaced) is
    dropped, so a dead group's gauges do not linger. ``export_to_ray`` also mirrors every push
    to Ray's metrics export (set in the actor; off in plain tests).

    Group failures, each of which makes Serve replace (restart) the group's replica, are counted
    by cause: ``engine_died`` (a report of a dead engine after a live one) and ``lost`` (a live
    group that stopped reporting without ``remove``, which a replica stopping on purpose calls)."""

    def __init__(self, stale_after_s: float = 30.0, export_to_ray: bool = False) -> None:
        self.stale_after_s = stale_after_s
        self._groups: Dict[str, GroupRecord] = {}
        self._failures: Dict[str, int] = {cause: 0 for cause in GROUP_FAILURE_CAUSES}
        self._info: Dict[str, Dict[str, Any]] = {}
        self._mirror = RayMetricsMirror() if export_to_ray else None
        self._ingress = ReplicaTotals(stale_after_s)

    def push_ingress(self, snapshot: ReplicaSnapshot) -> None:
        """An ingress replica's own numbers (`cluster.api.replica_totals`)."""
        self._ingress.push(snapshot)

    def ingress_families(self) -> List[FamilySnapshot]:
        """The ingress replicas' numbers, summed (`ReplicaTotals.families`)."""
        return self._ingress.families()

    def push(self, group_id: str, snapshot: Mapping[str, Any]) -> None:
        record = self._groups.get(group_id)
        if record is None:
            record = self._groups[group_id] = GroupRecord(time.monotonic(), {}, {})
        previous = dict(record.values)
        record.pushed_at = time.monotonic()
        for key, value in snapshot.items():
            if not _is_metric_key(key):
                logger.warning("group %s pushed an invalid metric name %r", group_id, key)
            elif isinstance(value, (list, tuple)):
                self._observe(group_id, record, key, value)
            elif isinstance(value, Mapping) and key in LABELLED_GROUP_METRICS:
                self._set_labelled(group_id, record, key, value)
            elif _is_number(value):
                record.values[key] = float(value)
        if previous.get("engine_alive") == 1.0 and record.values.get("engine_alive") == 0.0:
            self._count_failure("engine_died")
        if self._mirror is not None:
            self._mirror.group_values(group_id, previous, record.values)

    def _set_labelled(self, group_id: str, record: GroupRecord, key: str,
                      series: Mapping[Any, Any]) -> None:
        previous = record.labelled.get(key, {})
        current = {str(label): float(value) for label, value in series.items()
                   if _is_number(value)}
        record.labelled[key] = current
        if self._mirror is not None:
            for label, value in current.items():
                tags = {"group": group_id, LABELLED_GROUP_METRICS[key]: label}
                self._mirror.group_values(tags, {key: previous.get(label, 0.0)}, {key: value})

    def remove(self, group_id: str) -> None:
        """A group stopping on purpose (scale-down, redeploy, shutdown): not a failure."""
        self._groups.pop(group_id, None)
        self._info.pop(group_id, None)

    def group_failures(self) -> Dict[str, int]:
        """Failures by cause since the store started (see the class docstring)."""
        self._drop_stale()
        return dict(self._failures)

    def _count_failure(self, cause: str) -> None:
        self._failures[cause] += 1
        if self._mirror is not None:
            self._mirror.counter(PREFIX + "group_failures", 1, {"cause": cause})

    def _observe(self, group_id: str, record: GroupRecord, key: str,
                 samples: Sequence[Any]) -> None:
        hist = record.histograms.get(key)
        if hist is None:
            hist = record.histograms[key] = HistogramState(COLLECTIVE_BUCKETS)
        for sample in samples:
            if _is_number(sample):
                hist.observe(float(sample))
                if self._mirror is not None:
                    self._mirror.histogram(PREFIX + key, float(sample), {"group": group_id},
                                           hist.bounds)

    def describe(self, group_id: str, info: Mapping[str, Any]) -> None:
        """Where a group's ranks run (plain data for `tpserve status`); dropped with the group."""
        self._info[group_id] = dict(info)

    def descriptions(self) -> Dict[str, Dict[str, Any]]:
        """``describe``'s data of every live group."""
        live = self.snapshot()
        return {group_id: info for group_id, info in self._info.items() if group_id in live}

    def snapshot(self) -> Dict[str, GroupRecord]:
        """Every live group's record (copied by Ray when called through the actor)."""
        self._drop_stale()
        return dict(self._groups)

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for group_id in [g for g, r in self._groups.items()
                         if now - r.pushed_at > self.stale_after_s]:
            self._info.pop(group_id, None)
            if self._groups.pop(group_id).values.get("engine_alive") == 1.0:
                self._count_failure("lost")

    def serving_groups(self, max_age_s: float) -> List[str]:
        """Groups whose engine was alive in a report at most ``max_age_s`` old (this actor's
        clock: reports are stamped on arrival, never with a sender's clock)."""
        now = time.monotonic()
        return sorted(g for g, r in self._groups.items()
                      if now - r.pushed_at <= max_age_s and r.values.get("engine_alive") == 1.0)

    def group_ids(self) -> List[str]:
        return sorted(self.snapshot())


def group_metric_families(groups: Mapping[str, GroupRecord], model_name: str) -> List[Metric]:
    """The groups' records as Prometheus families, labelled ``group`` and ``model_name``."""
    labels = ["model_name", "group"]
    families: Dict[str, Metric] = {}
    for group_id in sorted(groups):
        record = groups[group_id]
        for key, value in sorted(record.values.items()):
            name, kind = group_metric_kind(key)
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(name, _help(key), labels=labels)
            family.add_metric([model_name, group_id], value)
        for key, hist in sorted(record.histograms.items()):
            name = PREFIX + key
            family = families.get(name)
            if family is None:
                family = families[name] = HistogramMetricFamily(name, _help(key), labels=labels)
            family.add_metric([model_name, group_id], hist.cumulative_buckets(), hist.sum)
        for key, series in sorted(record.labelled.items()):
            name, kind = group_metric_kind(key)
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(name, _help(key),
                                              labels=labels + [LABELLED_GROUP_METRICS[key]])
            for label, value in sorted(series.items()):
                family.add_metric([model_name, group_id, label], value)
    return list(families.values())


# ----- the router's decision counts (the router runs in the ingress process) -----

_router_sources: List[Any] = []


def register_router_decisions(counts: Mapping[str, int]) -> None:
    """Called by a router (``cluster.routing.kv_router``) with the mapping it counts reasons in; the
    ingress in the same process exports the sum over routers. Held weakly when possible."""
    try:
        _router_sources.append(weakref.ref(counts))
    except TypeError:
        _router_sources.append(lambda: counts)


def router_decision_counts() -> Dict[str, int]:
    totals: Dict[str, int] = {}
    live = []
    for ref in _router_sources:
        counts = ref()
        if counts is None:
            continue
        live.append(ref)
        for reason, n in _copy(counts).items():
            totals[str(reason)] = totals.get(str(reason), 0) + int(n)
    _router_sources[:] = live
    return totals


def _copy(counts: Mapping[str, int]) -> Dict[str, int]:
    """A copy of a mapping that a router on another thread may be adding a reason to."""
    for _ in range(3):
        try:
            return dict(counts)
        except RuntimeError:  # changed size during iteration
            continue
    return {}


# ----- Ray's metrics export -----


class RayMetricsMirror:
    """Mirrors metrics into ``ray.util.metrics`` (names with ``_`` for ``:``); lazily creates
    one Ray metric per name, its tag keys those of the first record."""

    def __init__(self) -> None:
        self._metrics: Dict[str, Any] = {}

    def _metric(self, kind: str, name: str, tag_keys: Tuple[str, ...],
                boundaries: Sequence[float] = ()) -> Any:
        ray_name = name.replace(":", "_")
        metric = self._metrics.get(ray_name)
        if metric is None:
            if kind == "histogram":
                metric = ray_metrics.Histogram(ray_name, name, list(boundaries), tag_keys)
            elif kind == "counter":
                metric = ray_metrics.Counter(ray_name, name, tag_keys)
            else:
                metric = ray_metrics.Gauge(ray_name, name, tag_keys)
            self._metrics[ray_name] = metric
        return metric

    def histogram(self, name: str, value: float, tags: Dict[str, str],
                  boundaries: Sequence[float]) -> None:
        self._metric("histogram", name, tuple(sorted(tags)), boundaries).observe(value, tags)

    def counter(self, name: str, delta: float, tags: Dict[str, str]) -> None:
        if delta > 0:  # Ray's Counter refuses zero and negative increments
            self._metric("counter", name, tuple(sorted(tags))).inc(delta, tags)

    def gauge(self, name: str, value: float, tags: Dict[str, str]) -> None:
        self._metric("gauge", name, tuple(sorted(tags))).set(value, tags)

    def group_values(self, group: Union[str, Dict[str, str]], previous: Mapping[str, float],
                     current: Mapping[str, float]) -> None:
        """``group``: the group's id, or the tags of a labelled series (the id among them)."""
        tags = {"group": group} if isinstance(group, str) else group
        for key, value in current.items():
            name, kind = group_metric_kind(key)
            if kind == "counter":
                self.counter(name, value - previous.get(key, 0.0), tags)
            else:
                self.gauge(name, value, tags)

    def request(self, model_name: str, observations: Sequence[Tuple[Any, float]],
                finished_reason: str, num_prompt_tokens: int,
                num_generation_tokens: int) -> None:
        """One finished request: ``observations`` pair a histogram spec (its ``name`` and
        ``buckets``, `cluster.api.metrics`) with a value."""
        tags = {"model_name": model_name}
        for spec, value in observations:
            self.histogram(spec.name, value, tags, spec.buckets)
        self.counter(PREFIX + "prompt_tokens", num_prompt_tokens, tags)
        self.counter(PREFIX + "generation_tokens", num_generation_tokens, tags)
        self.counter(PREFIX + "request_success", 1, {**tags, "finished_reason": finished_reason})


# ----- the store as a named Ray actor -----

MetricsStoreActor = ray.remote(MetricsStore)


def get_metrics_store(namespace: str = METRICS_NAMESPACE, stale_after_s: float = 30.0):
    """The cluster's ``MetricsStoreActor``, created on first use (by a group or the ingress).

    Detached: it must outlive whichever replica happened to create it, since replicas come and
    go; ``kill_metrics_store`` removes it when the application is torn down."""
    options = dict(name=METRICS_STORE_NAME, namespace=namespace, get_if_exists=True,
                   lifetime="detached", num_cpus=0)
    return MetricsStoreActor.options(**options).remote(stale_after_s=stale_after_s,
                                                       export_to_ray=True)


def existing_metrics_store(namespace: str = METRICS_NAMESPACE):
    """The cluster's ``MetricsStoreActor`` if it exists (never creates one), else None."""
    try:
        return ray.get_actor(METRICS_STORE_NAME, namespace=namespace)
    except ValueError:
        return None


def kill_metrics_store(namespace: str = METRICS_NAMESPACE) -> None:
    try:
        ray.kill(ray.get_actor(METRICS_STORE_NAME, namespace=namespace))
    except ValueError:
        pass  # never created
