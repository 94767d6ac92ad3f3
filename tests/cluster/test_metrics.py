"""The metrics store and the `/metrics` text, parsed back with prometheus-client's parser."""

import asyncio
import collections
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api import metrics as im
from cluster import metrics as m

SNAPSHOT = {
    "kv_usage_frac": 0.25, "kv_blocks_used": 32, "kv_blocks_total": 128,
    "tokens_in_flight": 100, "num_requests_running": 3, "num_requests_waiting": 1,
    "prefix_cache_queries_total": 40, "prefix_cache_hits_total": 12,
    "num_preemptions_total": 2, "allreduce_latency_seconds": [0.0004, 0.002, 3.0],
    "kv_tier_host_blocks_used": 7, "kv_tier_spills_total": 5,
}


def parse(text: bytes):
    """{family name: family}, and {(sample name, frozen labels): value}."""
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in families.values() for s in f.samples}
    return families, samples


def labels(**kw):
    return frozenset(kw.items())


def test_histogram_state_buckets():
    hist = m.HistogramState((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        hist.observe(v)
    assert hist.counts == [2, 1, 1]  # (.., 0.1], (0.1, 1], above
    assert hist.cumulative_buckets() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert hist.count == 4 and math.isclose(hist.sum, 2.65)


def test_store_keeps_latest_values_and_accumulates_samples():
    store = m.MetricsStore()
    store.push("g0", SNAPSHOT)
    store.push("g0", {**SNAPSHOT, "kv_usage_frac": 0.5, "allreduce_latency_seconds": [0.001]})
    store.push("g1", {"kv_usage_frac": 0.9, "bad name": 1, "note": "text", "nan": math.nan})
    groups = store.snapshot()
    assert sorted(groups) == ["g0", "g1"]
    assert groups["g0"].values["kv_usage_frac"] == 0.5
    assert groups["g0"].histograms["allreduce_latency_seconds"].count == 4
    assert groups["g1"].values == {"kv_usage_frac": 0.9}  # non-numbers and bad names dropped


def test_store_drops_groups_that_stopped_pushing(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(m.time, "monotonic", lambda: now[0])
    store = m.MetricsStore(stale_after_s=5.0)
    store.push("old", SNAPSHOT)
    now[0] = 103.0
    store.push("new", SNAPSHOT)
    now[0] = 106.0
    assert store.group_ids() == ["new"]


def test_metric_kinds_follow_names():
    assert m.group_metric_kind("kv_usage_frac") == ("tpserve:kv_cache_usage_perc", "gauge")
    assert m.group_metric_kind("kv_blocks_total") == ("tpserve:num_kv_blocks", "gauge")
    assert m.group_metric_kind("kv_tier_spills_total") == ("tpserve:kv_tier_spills", "counter")
    assert m.group_metric_kind("kv_tier_host_blocks_used") == (
        "tpserve:kv_tier_host_blocks_used", "gauge")


@pytest.fixture
def rendered():
    store = m.MetricsStore()
    store.push("g0", SNAPSHOT)
    store.push("g1", {**SNAPSHOT, "kv_usage_frac": 0.75, "allreduce_latency_seconds": []})
    ingress = im.IngressMetrics("tiny", max_model_len=256)
    timer = im.RequestTimer(arrival=10.0)
    for t in (10.2, 10.25, 10.35):
        timer.on_tokens(1, now=t)
    ingress.record(timer, num_prompt_tokens=7, num_generation_tokens=3, finished_reason="length",
                   now=10.4)
    ingress.record(im.RequestTimer(arrival=10.0), 5, 0, "abort", now=10.1)
    return parse(ingress.render(store.snapshot(), {"under_target": 4, "least_loaded": 1}))


def test_group_metrics_rendered(rendered):
    families, samples = rendered
    g0 = dict(model_name="tiny", group="g0")
    assert samples[("tpserve:kv_cache_usage_perc", labels(**g0))] == 0.25
    assert samples[("tpserve:kv_cache_usage_perc", labels(model_name="tiny", group="g1"))] == 0.75
    assert samples[("tpserve:num_requests_running", labels(**g0))] == 3
    assert samples[("tpserve:num_requests_waiting", labels(**g0))] == 1
    assert samples[("tpserve:tokens_in_flight", labels(**g0))] == 100
    assert samples[("tpserve:num_kv_blocks", labels(**g0))] == 128
    assert samples[("tpserve:num_kv_blocks_used", labels(**g0))] == 32
    assert samples[("tpserve:prefix_cache_queries_total", labels(**g0))] == 40
    assert samples[("tpserve:prefix_cache_hits_total", labels(**g0))] == 12
    assert samples[("tpserve:num_preemptions_total", labels(**g0))] == 2
    assert samples[("tpserve:kv_tier_host_blocks_used", labels(**g0))] == 7
    assert samples[("tpserve:kv_tier_spills_total", labels(**g0))] == 5
    for name in ("prefix_cache_hits", "num_preemptions", "kv_tier_spills"):
        assert families["tpserve:" + name].type == "counter"
    assert families["tpserve:kv_cache_usage_perc"].type == "gauge"


def test_allreduce_histogram_rendered(rendered):
    families, samples = rendered
    g0 = dict(model_name="tiny", group="g0")
    assert families["tpserve:allreduce_latency_seconds"].type == "histogram"
    assert samples[("tpserve:allreduce_latency_seconds_count", labels(**g0))] == 3
    assert samples[("tpserve:allreduce_latency_seconds_bucket", labels(**g0, le="0.0005"))] == 1
    assert samples[("tpserve:allreduce_latency_seconds_bucket", labels(**g0, le="1.0"))] == 2
    assert samples[("tpserve:allreduce_latency_seconds_bucket", labels(**g0, le="+Inf"))] == 3
    assert samples[("tpserve:allreduce_latency_seconds_count",
                    labels(model_name="tiny", group="g1"))] == 0


def test_request_metrics_rendered(rendered):
    families, samples = rendered
    tiny = dict(model_name="tiny")
    assert samples[("tpserve:time_to_first_token_seconds_count", labels(**tiny))] == 1
    assert math.isclose(samples[("tpserve:time_to_first_token_seconds_sum", labels(**tiny))], 0.2)
    assert samples[("tpserve:inter_token_latency_seconds_count", labels(**tiny))] == 2
    assert math.isclose(samples[("tpserve:inter_token_latency_seconds_sum", labels(**tiny))],
                        0.15)
    assert samples[("tpserve:inter_token_latency_seconds_bucket", labels(**tiny, le="0.075"))] == 1
    assert samples[("tpserve:e2e_request_latency_seconds_count", labels(**tiny))] == 2
    assert samples[("tpserve:request_prompt_tokens_sum", labels(**tiny))] == 12
    assert samples[("tpserve:request_generation_tokens_bucket", labels(**tiny, le="5.0"))] == 2
    assert samples[("tpserve:prompt_tokens_total", labels(**tiny))] == 12
    assert samples[("tpserve:generation_tokens_total", labels(**tiny))] == 3
    assert samples[("tpserve:request_success_total",
                    labels(**tiny, finished_reason="length"))] == 1
    assert samples[("tpserve:request_success_total",
                    labels(**tiny, finished_reason="abort"))] == 1
    assert not any(name.endswith("_created") for name, _ in samples)


def test_router_decisions_rendered(rendered):
    families, samples = rendered
    assert families["tpserve:router_decisions"].type == "counter"
    assert samples[("tpserve:router_decisions_total", labels(reason="under_target"))] == 4
    assert samples[("tpserve:router_decisions_total", labels(reason="least_loaded"))] == 1


def test_router_decision_sources_sum_and_expire(monkeypatch):
    monkeypatch.setattr(m, "_router_sources", [])
    a = collections.Counter(under_target=2)
    b = collections.Counter(under_target=1, least_loaded=3)
    m.register_router_decisions(a)
    m.register_router_decisions(b)
    a["prefix_affinity"] += 1  # counted live, not copied at registration
    assert m.router_decision_counts() == {"under_target": 3, "least_loaded": 3,
                                          "prefix_affinity": 1}
    del b
    assert m.router_decision_counts() == {"under_target": 2, "prefix_affinity": 1}


def test_token_buckets():
    assert im._one_two_five_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_empty_render_parses():
    families, _ = parse(im.IngressMetrics("x", 16).render({}, {}))
    assert "tpserve:time_to_first_token_seconds" in families


def test_a_tiered_engines_numbers_reach_metrics_text(tiny_llama, tmp_path):
    """A real engine with host and disk tiers: its group snapshot carries the kv_tier_* numbers
    and /metrics renders them (counters, gauges, the transfer latency histogram)."""
    from cluster.groups.deployment import group_metrics_snapshot
    from workers.async_engine import AsyncLLMEngine
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.sampling_params import SamplingParams

    disk_dirs = [str(tmp_path / "kv0"), str(tmp_path / "kv1")]
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=16, max_num_seqs=1,
                          host_kv_blocks=4, disk_kv_dir=",".join(disk_dirs), disk_kv_blocks=32)
    engine = AsyncLLMEngine(lambda: LLMEngine(config))

    async def one(prompt, request_id):
        return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=2),
                                                       request_id)]

    try:
        for number, prompt in enumerate(([5] * 30 + [6], [7] * 30 + [8], [5] * 30 + [9])):
            asyncio.run(one(prompt, f"r{number}"))
        snapshot = group_metrics_snapshot(engine)
    finally:
        engine.shutdown()
    assert snapshot["kv_tier_spilled_bytes_total"] > 0
    assert snapshot["kv_tier_disk_written_bytes_total"] > 0
    # Every kind from 0 (a counter must exist before it first moves); no GPU on a CPU rank.
    assert snapshot["collective_errors_total"] == {"error": 0, "timeout": 0, "hang": 0}
    assert not any(key.startswith("gpu_memory") for key in snapshot)
    store = m.MetricsStore()
    store.push("g0", snapshot)
    _, samples = parse(im.IngressMetrics("tiny", 256).render(store.snapshot(), {}))
    g0 = labels(model_name="tiny", group="g0")
    assert samples[("tpserve:kv_tier_host_blocks_total", g0)] == 4
    assert samples[("tpserve:kv_tier_disk_blocks_total", g0)] == 32
    assert samples[("tpserve:kv_tier_spilled_bytes_total", g0)] == snapshot[
        "kv_tier_spilled_bytes_total"]
    assert samples[("tpserve:kv_tier_checksum_failures_total", g0)] == 0
    assert samples[("tpserve:kv_tier_transfer_latency_seconds_count", g0)] >= 1
    by_dir = [samples[("tpserve:kv_tier_disk_dir_written_bytes_total",
                       labels(model_name="tiny", group="g0", dir=d))] for d in disk_dirs]
    assert sum(by_dir) == snapshot["kv_tier_disk_written_bytes_total"]


def test_per_directory_disk_bytes_rendered_with_a_dir_label():
    """A striped disk tier's bytes by --disk-kv-dir entry: one counter series per directory."""
    store = m.MetricsStore()
    per_dir = {"kv_tier_disk_dir_written_bytes_total": {"/nvme0/kv": 8192, "/nvme1/kv": 4096},
               "kv_tier_disk_dir_read_bytes_total": {"/nvme0/kv": 0, "/nvme1/kv": 4096},
               "kv_tier_unknown_mapping": {"x": 1}}
    store.push("g0", {**SNAPSHOT, **per_dir})
    store.push("g0", {**SNAPSHOT, **per_dir, "kv_tier_disk_dir_written_bytes_total": {
        "/nvme0/kv": 12288, "/nvme1/kv": 4096}})
    assert store.snapshot()["g0"].labelled["kv_tier_disk_dir_written_bytes_total"] == {
        "/nvme0/kv": 12288.0, "/nvme1/kv": 4096.0}
    families, samples = parse(im.IngressMetrics("tiny", 256).render(store.snapshot(), {}))
    family = families["tpserve:kv_tier_disk_dir_written_bytes"]
    assert family.type == "counter"
    g0 = dict(model_name="tiny", group="g0")
    assert samples[("tpserve:kv_tier_disk_dir_written_bytes_total",
                    labels(**g0, dir="/nvme0/kv"))] == 12288
    assert samples[("tpserve:kv_tier_disk_dir_written_bytes_total",
                    labels(**g0, dir="/nvme1/kv"))] == 4096
    assert samples[("tpserve:kv_tier_disk_dir_read_bytes_total",
                    labels(**g0, dir="/nvme1/kv"))] == 4096
    assert not any("unknown_mapping" in name for name, _ in samples)  # only declared mappings


def test_collective_errors_by_kind_and_gpu_memory_by_rank_rendered():
    store = m.MetricsStore()
    store.push("g0", {**SNAPSHOT,
                      "collective_errors_total": {"error": 0, "timeout": 1, "hang": 1},
                      "gpu_memory_used_bytes": {"0": 60e9, "1": 70e9},
                      "gpu_memory_total_bytes": {"0": 80e9, "1": 80e9}})
    families, samples = parse(im.IngressMetrics("tiny", 256).render(store.snapshot(), {}))
    g0 = dict(model_name="tiny", group="g0")
    assert families["tpserve:collective_errors"].type == "counter"
    assert "by kind" in families["tpserve:collective_errors"].documentation
    assert samples[("tpserve:collective_errors_total", labels(**g0, kind="error"))] == 0
    assert samples[("tpserve:collective_errors_total", labels(**g0, kind="timeout"))] == 1
    assert samples[("tpserve:collective_errors_total", labels(**g0, kind="hang"))] == 1
    assert families["tpserve:gpu_memory_used_bytes"].type == "gauge"
    assert samples[("tpserve:gpu_memory_used_bytes", labels(**g0, rank="1"))] == 70e9
    assert samples[("tpserve:gpu_memory_total_bytes", labels(**g0, rank="0"))] == 80e9
    assert "CUDA-graph replays" in families["tpserve:allreduce_latency_seconds"].documentation


def test_requests_in_flight_and_their_limit_rendered():
    from cluster.api.admission import IngressAdmission

    ingress = im.IngressMetrics("tiny", 256)
    admission = IngressAdmission(max_in_flight=8)
    ingress.track_admission(admission)
    release = admission.acquire(count=3)
    _, samples = parse(ingress.render({}, {}))
    assert samples[("tpserve:ingress_requests_in_flight", labels(model_name="tiny"))] == 3
    assert samples[("tpserve:ingress_max_requests_in_flight", labels(model_name="tiny"))] == 8
    release()
    _, samples = parse(ingress.render({}, {}))
    assert samples[("tpserve:ingress_requests_in_flight", labels(model_name="tiny"))] == 0
