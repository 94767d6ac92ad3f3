"""Multi-node Ray clusters on one machine for tests (`ray.cluster_utils.Cluster` on loopback)."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Sequence

import pytest


@contextlib.contextmanager
def loopback_cluster(nodes: Sequence[Dict]) -> Iterator[object]:
    """Start one Ray node per ``add_node`` kwargs in ``nodes``, connect the driver, and stop it all.

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
