"""The Serve application's configuration: router choice (and the baseline routers' token
prefixes) and validation."""

import pytest

from cluster.app import ServeConfig, kv_aware_router_config, parse_groups, router_config
from cluster.routing.kv_router import KVAwareRouter
from cluster.routing.settings import RouterSettings
from workers.config import EngineConfig


def settings(config) -> RouterSettings:
    return RouterSettings(**config.request_router_kwargs)


def test_serve_config_router_choice():
    engine = EngineConfig(model="default")
    kv = router_config(ServeConfig(engine=engine, kv_target_occupancy=0.6))
    # every setting spelled out by kv_aware_router_config, the same as the router's defaults
    assert kv.request_router_kwargs == kv_aware_router_config(
        target_occupancy=0.6, block_size=engine.block_size).request_router_kwargs
    # the router counts a request's blocks at the engine's block size, as the ingress hashes them
    assert RouterSettings(**kv.request_router_kwargs) == RouterSettings(
        target_occupancy=0.6, block_size=engine.block_size)
    assert KVAwareRouter.__name__ in str(kv.request_router_class)
    pow2 = router_config(ServeConfig(engine=engine, router="pow2"))
    assert "PowerOfTwoChoices" in str(pow2.request_router_class)
    prefix = router_config(ServeConfig(engine=engine, router="prefix_affinity"))
    assert "TokenPrefixAffinityRouter" in str(prefix.request_router_class)
    round_robin = router_config(ServeConfig(engine=engine, router="round_robin"))
    assert "RoundRobinRouter" in str(round_robin.request_router_class)
    with pytest.raises(ValueError, match="router must be one of kv, pow2, prefix_affinity"):
        ServeConfig(engine=engine, router="random")


def test_prefix_affinity_keys_on_token_ids():
    from types import SimpleNamespace

    from cluster.contract import GroupRequest
    from cluster.routing.baseline_routers import TokenPrefixAffinityRouter, token_ids_as_text
    from workers.request import RequestId
    from workers.sampling_params import SamplingParams

    a, b = token_ids_as_text([5, 0xD800, 70000]), token_ids_as_text([5, 0xD800, 9])
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert all(not 0xD800 <= ord(c) < 0xE000 for c in a)  # no lone surrogates
    router = TokenPrefixAffinityRouter.__new__(TokenPrefixAffinityRouter)  # no Serve state
    sent = GroupRequest(RequestId("r"), (5, 6), SamplingParams())
    request = SimpleNamespace(args=(sent,), kwargs={})
    assert router._extract_text_from_request(request) == token_ids_as_text([5, 6])
    with pytest.raises(ValueError, match="prompt attribute"):
        router._extract_text_from_request(SimpleNamespace(args=({"x": 1},), kwargs={}))


def test_groups_flag():
    assert parse_groups("2") == (2, 2) and parse_groups("1:4") == (1, 4)
    with pytest.raises(ValueError, match="--groups must be N or MIN:MAX"):
        parse_groups("a:b")
    with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
        ServeConfig(engine=EngineConfig(model="default"), min_groups=3, max_groups=2)


def test_the_ingress_serves_the_context_the_engines_serve(tiny_llama):
    from cluster.app import served_context_length
    from workers.model_config import load_model_config

    model = load_model_config(tiny_llama)  # max_position_embeddings 256
    engine = EngineConfig(model=str(tiny_llama), block_size=4)
    assert served_context_length(engine, model) == 256
    lowered = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=8)
    assert served_context_length(lowered, model) == 32  # as the engine lowers it
    with pytest.raises(ValueError, match="--max-model-len 64 does not fit"):
        served_context_length(EngineConfig(model=str(tiny_llama), block_size=4,
                                           num_kv_blocks=8, max_model_len=64), model)


def test_ranks_placed_on_cpu_shares_run_on_cpu_whatever_gpus_their_node_has():
    # A rank that asks Ray for no GPU sees every GPU of its node: "auto" would take CUDA and put
    # every rank of the node on cuda:0. Given a GPU (or a plan), the device stays as asked.
    from cluster.app import group_resources, rank_engine_config

    engine = EngineConfig(model="default")  # device "auto"
    config = ServeConfig(engine=engine)
    on_cpus = group_resources(config, {"CPU": 8.0})
    assert on_cpus.gpus_per_rank == 0
    assert rank_engine_config(engine, on_cpus, None).device == "cpu"
    on_gpus = group_resources(config, {"CPU": 8.0, "GPU": 2.0})
    assert rank_engine_config(engine, on_gpus, None).device == "auto"
    cuda = EngineConfig(model="default", device="cuda")
    assert rank_engine_config(cuda, on_cpus, None).device == "cuda"  # asked for: kept
