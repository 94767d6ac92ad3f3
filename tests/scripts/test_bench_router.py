"""scripts/bench_router.py: both routers timed, hot and cold, the JSON last line; bad flags."""

from __future__ import annotations

import dataclasses
import json

from bench_scripts import load_script, run_script
from cluster.contract import LoadReport


def test_times_both_routers_hot_and_cold_and_ends_with_json():
    result = run_script("bench_router", "--groups", "2,30", "--decisions", "20", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for groups in (2, 30):
        for mode in ("hot", "cold"):
            for router in ("kv", "kv_python", "pow2"):
                assert figures[f"{router}_us_p50_{mode}_{groups}"] > 0


def test_the_python_column_times_the_router_without_its_c_ranking():
    bench = load_script("bench_router")
    import asyncio
    import random

    rng = random.Random(0)
    replicas = bench.fleet(30, bench.conversations(rng), rng)
    loop = asyncio.new_event_loop()
    try:
        for kind, native in (("kv", True), ("kv_python", False)):
            router = bench.make_router(kind, replicas, loop)
            assert (router._fleet_cache.native is not None) == native
    finally:
        loop.close()


def test_the_kv_router_places_by_prefix_in_the_timed_fleet():
    """The timed decisions are real ones: a request whose conversation a group caches goes
    there (or to a group with an equal prefix)."""
    bench = load_script("bench_router")
    import asyncio
    import random

    rng = random.Random(0)
    convs = bench.conversations(rng)
    replicas = bench.fleet(4, convs, rng)
    for replica in replicas:  # equal loads: the cached prefix decides
        report = LoadReport.from_stats(replica.routing_stats)
        replica.routing_stats = dataclasses.replace(report, num_blocks_used=100).to_stats()
    loop = asyncio.new_event_loop()
    try:
        router = bench.make_router("kv", replicas, loop)
        holder = replicas[2]
        cached = LoadReport.from_stats(holder.routing_stats).cached_block_hashes
        conv = next(c for c in convs if c[bench.SYSTEM_BLOCKS] in cached)
        length = next(i for i, h in enumerate(conv) if h not in cached)
        request = bench.PendingRequest("r", {"num_tokens": 100, "block_size": bench.BLOCK_SIZE,
                                             "block_hashes": conv[:length]})
        ranks, elapsed = bench.decide(router, replicas, request, loop)
        best = LoadReport.from_stats(ranks[0][0].routing_stats).cached_block_hashes
        assert all(h in best for h in conv[:length]) and elapsed > 0
    finally:
        loop.close()


def test_bad_flags_are_refused_by_name():
    result = run_script("bench_router", "--groups", "2,x", timeout=60)
    assert result.returncode == 2 and "--groups" in result.stderr
