"""The environment each rank of a planned group starts with (`parallel.rank_env`): its device,
the nearest InfiniBand HCAs, and the socket interface."""

from __future__ import annotations

import dataclasses

import pytest

from parallel.grouping import plan_groups
from parallel.rank_env import nearest_hcas, rank_env

from test_grouping import cpu_node, dgx


def test_rank_env_inside_a_node_sets_only_the_device():
    a = dgx("a")
    group = plan_groups([a], 2).groups[1]
    assert rank_env(group, 1, a) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}


def test_rank_env_of_a_spanning_group_limits_hcas_to_the_nearest():
    nodes = [dgx(n, down=[5] if n == "a" else []) for n in "ab"]
    group = plan_groups(nodes, 16).groups[0]
    env = rank_env(group, 9, nodes[1], socket_ifname="eth1")
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{k}:1" for k in range(8))
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert "mlx5_5:1" not in rank_env(group, 0, nodes[0])["NCCL_IB_HCA"]  # a port down


def test_rank_env_takes_the_socket_interface_the_probe_found():
    """Each rank gets its own node's interface (a veth in one namespace, eth0 in another);
    a configured interface overrides it."""
    nodes = [dataclasses.replace(dgx(n), socket_ifname=f"veth-{n}") for n in "ab"]
    group = plan_groups(nodes, 16).groups[0]
    assert rank_env(group, 0, nodes[0])["GLOO_SOCKET_IFNAME"] == "veth-a"
    assert rank_env(group, 8, nodes[1])["NCCL_SOCKET_IFNAME"] == "veth-b"
    assert rank_env(group, 8, nodes[1], socket_ifname="ib0")["GLOO_SOCKET_IFNAME"] == "ib0"


def test_nearest_hcas_follow_pix_affinity_then_fall_back():
    a = dgx("a", down=[2])
    assert nearest_hcas(a, [0, 1]) == ["mlx5_0:1", "mlx5_1:1"]
    # GPU 2's own HCA is down: every active HCA is equally near (NODE).
    assert nearest_hcas(a, [2]) == [f"mlx5_{k}:1" for k in range(8) if k != 2]
    no_affinity = dataclasses.replace(a, gpu_topology=dataclasses.replace(a.gpu_topology, nics=()))
    assert len(nearest_hcas(no_affinity, [0])) == 7


def test_rank_env_for_cpu_ranks_and_bad_ranks():
    a, b = cpu_node("a"), cpu_node("b")
    group = plan_groups([a, b], 4).groups[0]
    assert rank_env(group, 3, b) == {}
    assert rank_env(group, 0, a, socket_ifname="veth0") == {
        "NCCL_SOCKET_IFNAME": "veth0", "GLOO_SOCKET_IFNAME": "veth0"}
    with pytest.raises(ValueError, match="rank 0 runs on a, not on b"):
        rank_env(group, 0, b)
    with pytest.raises(ValueError, match="rank 4 is not in a group of 4"):
        rank_env(group, 4, a)
