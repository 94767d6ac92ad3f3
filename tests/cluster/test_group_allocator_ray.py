"""The cluster's group allocator, a detached actor that outlives applications, met by a
deployment with another formation: replaced when no live replica holds its groups, refused by
name while one does (on a local Ray)."""

import time

import pytest
import ray

from cluster.groups.formation import FormationConfig
from cluster.groups.allocator import (AllocatorConfigError, get_group_allocator,
                                     kill_group_allocator)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        kill_group_allocator()
        ray.shutdown()


@ray.remote(num_cpus=0)
class Replica:
    """Stands for a serving replica: the allocator only checks that its actor is alive."""

    def ping(self) -> int:
        return 1


def test_an_allocator_for_another_formation_is_replaced_once_nothing_holds_it(local_ray):
    tp1 = FormationConfig(tp_size=1, cpus_per_rank=0.5)
    tp2 = FormationConfig(tp_size=2, cpus_per_rank=0.5)
    first = get_group_allocator(tp1)
    assert ray.get(first.config_in_use.remote()) == (tp1, 0)
    assert get_group_allocator(tp1)._actor_id == first._actor_id  # the same formation: kept
    replica = Replica.remote()
    ray.get(first.claim.remote("replica-1", replica))
    # Before: the old allocator answered with 1-rank groups, and a 2-rank group's rank 1
    # asked its placement group for a bundle it does not have.
    with pytest.raises(AllocatorConfigError, match="1 live replica"):
        get_group_allocator(tp2)
    ray.kill(replica)  # the old application's replica is gone
    # ray.kill returns before the actor is dead; a CI run on a loaded host asked the allocator
    # while the replica still answered (the allocator then rightly counted it as a holder).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(replica.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.1)
    second = get_group_allocator(tp2)
    assert ray.get(second.config_in_use.remote()) == (tp2, 0)
    assert len(ray.get(second.claim.remote("replica-2", Replica.remote())).group.ranks) == 2


def test_a_refusal_stays_in_the_status_after_the_refused_replica_goes(local_ray):
    kill_group_allocator()  # a fresh plan: one group of one CPU rank
    allocator = get_group_allocator(FormationConfig(tp_size=1, num_groups=1, cpus_per_rank=0.5))
    holder, refused = Replica.remote(), Replica.remote()
    ray.get(allocator.claim.remote("replica-a", holder))
    with pytest.raises(ray.exceptions.RayTaskError, match="replica-b has no planned group"):
        ray.get(allocator.claim.remote("replica-b", refused))
    # The refused replica's teardown gives back what it holds. Before, that dropped its refusal
    # too, so `tpserve status` showed no error seconds after the refusal while Serve went on
    # starting replicas that the plan cannot place.
    ray.get(allocator.release.remote("replica-b"))
    refusals = ray.get(allocator.status.remote())["refusals"]
    assert [r["replica"] for r in refusals] == ["replica-b"]
    assert "has no planned group" in refusals[0]["message"]
    # Replicas refused one after another are all shown, the latest few of them.
    for k in range(40):
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(allocator.claim.remote(f"replica-c{k}", refused))
    refusals = ray.get(allocator.status.remote())["refusals"]
    assert [r["replica"] for r in refusals] == [f"replica-c{k}" for k in range(24, 40)]
    # A claim that succeeds again (the group given back, or a node joined) clears them.
    ray.kill(holder)
    ray.get(allocator.claim.remote("replica-d", refused))
    assert ray.get(allocator.status.remote())["refusals"] == []
