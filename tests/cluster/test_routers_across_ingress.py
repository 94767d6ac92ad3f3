"""Several ingress replicas route over the same groups, each with its own router: a router
charges only the requests it sent, and drops each charge once the group's report lists the
request, so after a report every router sees the group's load the same and none counts a
request twice (cluster.routing.load_report), without Ray."""

from __future__ import annotations

import random

from cluster.contract import LoadReport
from cluster.routing.load_report import ReplicaLoadTracker


def stats(seq: int, used: int, waiting: int, accepted) -> dict:
    return LoadReport(seq=seq, time=0.0, num_blocks_used=used, num_blocks_total=100,
                      block_size=16, num_waiting_tokens=waiting, cached_block_hashes=frozenset(),
                      accepted_ids=frozenset(accepted)).to_stats()


def test_two_routers_agree_on_a_group_once_its_report_lists_their_requests():
    rng = random.Random(5)
    routers = [ReplicaLoadTracker("g", charge_ttl_s=60.0) for _ in range(2)]
    sent = {0: {}, 1: {}}  # router -> request id -> tokens, not yet in a report
    in_group = 0  # tokens of the requests the group holds (its reports' numbers)
    seq = 0
    for step in range(300):
        now = float(step) * 0.01
        if rng.random() < 0.7:  # one of the routers sends a request
            who = rng.randrange(2)
            request_id, tokens = f"r{step}", rng.randrange(1, 200)
            routers[who].charge(request_id, tokens, now)
            sent[who][request_id] = tokens
        else:  # the group reports everything it accepted so far
            seq += 1
            accepted = {r for pending in sent.values() for r in pending}
            in_group += sum(t for pending in sent.values() for t in pending.values())
            report = stats(seq, used=0, waiting=in_group, accepted=accepted)
            for router in routers:
                router.observe(report, now)
            sent = {0: {}, 1: {}}
            loads = [router.observe(report, now) for router in routers]
            assert [load.num_tokens_sent_since_report for load in loads] == [0, 0], step
            assert loads[0].num_waiting_tokens == loads[1].num_waiting_tokens == in_group
        for who, router in enumerate(routers):
            # each router counts the report, plus its own requests sent since: never another's
            assert router.num_tokens_sent == sum(sent[who].values()), step
