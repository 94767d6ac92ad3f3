"""Multi-node Ray clusters on one machine for tests (`ray.cluster_utils.Cluster` on loopback)."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Sequence

import pytest


def stop_local_ray() -> None:
    """Stops the Ray this process started, and Serve with it. ``ray.shutdown()`` alone: the
    cluster's processes (Serve's controller, proxies and replicas, named actors) end with it,
    and a ``serve.shutdown()`` first would stop the deployments one after another, each after
    Serve's graceful wait (2 s), seconds of every module's teardown."""
    import ray

    ray.shutdown()


@contextlib.contextmanager
def loopback_cluster(nodes: Sequence[Dict]) -> Iterator[object]:
    """Start one Ray node per ``add_node`` kwargs in ``nodes``, connect the driver, and stop it all
    (Serve and every actor with it: no ``serve.shutdown()`` needed, see `stop_local_ray`).

    On loopback the driver hangs connecting to GCS unless Ray keeps to 127.0.0.1. Ray reads the
    variable when it is imported: set it for the processes the cluster starts, and patch the
    constant it became in this (already importing) process.
    """
    import ray
    from ray.cluster_utils import Cluster

    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster()
    try:
        for node in nodes:
            cluster.add_node(**node)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        patch.undo()
