"""The numbers of every ingress replica, summed, so that ``/metrics`` says the same whichever
replica answers it.

Each replica sends the metric store a ``ReplicaSnapshot`` of its own registry (its request
counters and histograms, its routers' decisions) about once a second and when it answers
``/metrics``; ``ReplicaTotals`` keeps the latest one per replica and sums them:

- counters and histograms (every sample of them is a running total) over every replica seen, so
  a total never goes down when a replica stops (scale-down, a restart): its last numbers stay;
- gauges over the replicas that reported within ``stale_after_s`` (the live ones).

Replicas beyond ``max_replicas`` that stopped reporting are folded into one retired total
(their counters and histograms), which bounds the memory of a long-lived store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Tuple

from prometheus_client.core import Metric

Labels = Tuple[Tuple[str, str], ...]
Sample = Tuple[str, Labels, float]  # (sample name, sorted labels, value)
CUMULATIVE = ("counter", "histogram")


@dataclass(frozen=True)
class FamilySnapshot:
    """One metric family's samples, in plain data that Ray ships between processes."""

    name: str
    type: str  # Prometheus' type: counter, gauge, histogram, ...
    documentation: str
    samples: Tuple[Sample, ...]


@dataclass(frozen=True)
class ReplicaSnapshot:
    replica_id: str
    families: Tuple[FamilySnapshot, ...]


def family_snapshots(families: Iterable[Metric]) -> Tuple[FamilySnapshot, ...]:
    """``prometheus_client`` families (a registry's ``collect()``) as plain data."""
    return tuple(
        FamilySnapshot(f.name, f.type, f.documentation,
                       tuple((s.name, tuple(sorted(s.labels.items())), float(s.value))
                             for s in f.samples))
        for f in families)


class ReplicaTotals:
    """The latest snapshot of each replica, and their sums (see the module doc)."""

    def __init__(self, stale_after_s: float = 30.0, max_replicas: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self.max_replicas = max_replicas
        self._clock = clock
        self._latest: "OrderedDict[str, Tuple[float, ReplicaSnapshot]]" = OrderedDict()
        self._retired: Dict[str, FamilySnapshot] = {}

    def push(self, snapshot: ReplicaSnapshot) -> None:
        self._latest.pop(snapshot.replica_id, None)
        self._latest[snapshot.replica_id] = (self._clock(), snapshot)  # newest last
        while len(self._latest) > self.max_replicas:
            pushed_at, oldest = next(iter(self._latest.values()))
            if self._clock() - pushed_at <= self.stale_after_s:
                break  # every replica kept is live: keep them all
            self._latest.popitem(last=False)
            self._retired = {f.name: f for f in _summed(
                [*self._retired.values(), *_cumulative(oldest.families)])}

    def families(self) -> List[FamilySnapshot]:
        """Every family summed over the replicas: gauges over the live ones only."""
        now = self._clock()
        parts: List[FamilySnapshot] = list(self._retired.values())
        for pushed_at, snapshot in self._latest.values():
            live = now - pushed_at <= self.stale_after_s
            parts.extend(snapshot.families if live else _cumulative(snapshot.families))
        return _summed(parts)

    def replica_ids(self) -> List[str]:
        return list(self._latest)


def _cumulative(families: Iterable[FamilySnapshot]) -> List[FamilySnapshot]:
    return [f for f in families if f.type in CUMULATIVE]


def _summed(parts: Iterable[FamilySnapshot]) -> List[FamilySnapshot]:
    """Families of the same name merged, samples with the same name and labels added."""
    kinds: Dict[str, Tuple[str, str]] = {}
    values: Dict[str, Dict[Tuple[str, Labels], float]] = {}
    for family in parts:
        kinds.setdefault(family.name, (family.type, family.documentation))
        into = values.setdefault(family.name, {})
        for name, labels, value in family.samples:
            into[(name, labels)] = into.get((name, labels), 0.0) + value
    return [FamilySnapshot(name, kinds[name][0], kinds[name][1],
                           tuple((s, labels, v) for (s, labels), v in values[name].items()))
            for name in kinds]


def as_metrics(families: Iterable[FamilySnapshot]) -> List[Metric]:
    """Plain families back as ``prometheus_client`` families, for the text exposition."""
    out = []
    for family in families:
        metric = Metric(family.name, family.documentation, family.type)
        for name, labels, value in family.samples:
            metric.add_sample(name, dict(labels), value)
        out.append(metric)
    return out
