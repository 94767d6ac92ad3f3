"""An ingress replica's side of the metric store: its ``/metrics`` and ``/health`` answers, and
its own numbers pushed to the store about once a second so that every replica's ``/metrics``
sums all of them (`cluster.api.replica_totals`).

When the store cannot be reached (gone, or slower than ``STORE_TIMEOUT_S``), ``/metrics`` still
answers with this replica's own numbers, and the next call tries to reach (or recreate) it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, List, Optional

from cluster.api.metrics import IngressMetrics
from cluster.metrics import get_metrics_store, router_decision_counts

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 2.0
PUSH_PERIOD_S = 1.0


def replica_id() -> str:
    """This Serve replica's id; a random one outside a replica (tests, scripts)."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"ingress-{uuid.uuid4().hex[:8]}"


class MetricsPage:
    """``/metrics`` and the store calls of one ingress replica."""

    def __init__(self, metrics: IngressMetrics, replica: Optional[str] = None) -> None:
        self.metrics = metrics
        self.replica_id = replica or replica_id()
        self._store = get_metrics_store()
        self._pusher: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Starts the periodic push (once; call from the replica's event loop)."""
        if self._pusher is None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_forever())

    async def text(self) -> bytes:
        self.start()
        self._push()  # the store runs one caller's calls in order: this one is counted below
        groups = await self._call("snapshot", {})
        failures = await self._call("group_failures", None)
        replicas = await self._call("ingress_families", None)
        if replicas is None:  # this replica's numbers alone beat none
            return self.metrics.render(groups, router_decision_counts(), failures)
        return self.metrics.render(groups, {}, failures, replicas)

    async def serving_groups(self, max_age_s: float) -> List[str]:
        """The groups that reported a live engine within ``max_age_s`` ([] if unknown)."""
        return await self._call("serving_groups", [], max_age_s)

    async def _call(self, method: str, default: Any, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self._store, method).remote(*args),
                                          STORE_TIMEOUT_S)
        except Exception as exc:  # the store is gone or slow
            logger.warning("metrics store unavailable for %s (%s)", method, exc)
            self._reconnect()
            return default

    def _reconnect(self) -> None:
        try:
            self._store = get_metrics_store()
        except Exception:
            logger.exception("cannot reach or recreate the metrics store")

    def _push(self) -> None:
        snapshot = self.metrics.replica_snapshot(self.replica_id, router_decision_counts())
        try:
            self._store.push_ingress.remote(snapshot)
        except Exception as exc:
            logger.warning("cannot push this replica's metrics (%s)", exc)
            self._reconnect()

    async def _push_forever(self) -> None:
        while True:
            self._push()
            await asyncio.sleep(PUSH_PERIOD_S)

