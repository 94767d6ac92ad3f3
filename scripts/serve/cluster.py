"""The Serve side of the serving benchmark: one local Ray, and per run a fresh Serve application
(``cluster.app.build_app``) whose group deployment uses the router under test; the KV-aware
routers' decision records are read from the ingress replica."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Sequence

from scripts.serve.host_load import cpu_snapshot, load_average, other_cpu_frac
from scripts.serve.replay import RunResult, add_counts, log, replay
from scripts.serve.workload import MIN_PROMPT_TOKEN_ID, BenchRequest

APP_NAME = "tpserve-bench"
WARMUP_PROMPT_TOKENS = 32
WARMUP_MAX_TOKENS = 4
OTHER_CPU_WARN_FRAC = 0.10


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the runs send their requests, and what they warm up with."""

    port: int
    model: str
    vocab_size: int
    num_warmup_requests: int
    max_duration_s: float
    drain_timeout_s: float
    request_timeout_s: float

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@contextmanager
def local_serve(num_cpus: int) -> Iterator[int]:
    """A fresh local Ray with Serve's HTTP proxy on a free port (yielded); all of it stopped at
    the end. ``address="local"``: never another Ray that happens to run on this host."""
    import ray

    from cluster.cli.serve import use_serve_transport

    use_serve_transport()  # the transport `tpserve serve` gives its local Ray
    ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    try:
        yield start_serve()
    finally:
        # Serve and its named actors end with the Ray this started; serve.shutdown() first
        # would wait out each deployment's graceful stop.
        ray.shutdown()


def start_serve(attempts: int = 3) -> int:
    """Serve's proxy on a free port; another one if a process on this shared host takes the
    port between our probe and Serve's bind."""
    from ray import serve

    from cluster.ports import free_port

    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as exc:  # Serve raises a RayTaskError wrapping the bind failure
            if "Failed to bind" not in str(exc) or attempt == attempts - 1:
                raise
            log(f"port {port} was taken before Serve bound it; trying another")
            serve.shutdown()
    raise AssertionError("unreachable")



def build_bench_app(config: Any, router: str) -> Any:
    """tpserve's application with the given router (``cluster.app_config.ROUTERS``)."""
    import ray

    from cluster.app import build_app

    return build_app(dataclasses.replace(config, router=router), ray.cluster_resources())


def _routers_in_process(_replica: Any) -> Dict[str, Any]:
    """Runs inside the ingress replica (``__ray_call__``): its KV-aware routers' records."""
    from cluster.routing import kv_router

    routers = kv_router.live_routers()
    counts: Dict[str, int] = {}
    given_up: Dict[str, int] = {}
    for router in routers:
        add_counts(counts, router.decision_counts())
        left = router.prefix_given_up()
        add_counts(given_up, left["decisions"])
        add_counts(given_up, {f"{k}_blocks": n for k, n in left["blocks"].items()})
    return {"num_routers": len(routers), "counts": counts, "given_up": given_up,
            "times_us": [t for router in routers for t in router.decision_times_us()]}


def read_router_stats() -> Dict[str, Any]:
    """The KV-aware routers' decision counts and times, from every ingress replica."""
    import ray
    from ray import cloudpickle

    module = sys.modules[_routers_in_process.__module__]
    if module.__name__ != "__main__":  # imported (tests): not importable in the replica
        cloudpickle.register_pickle_by_value(module)
    merged: Dict[str, Any] = {"num_routers": 0, "counts": {}, "given_up": {}, "times_us": []}
    prefix = f"SERVE_REPLICA::{APP_NAME}#OpenAIIngress#"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not actor["name"].startswith(prefix):
            continue
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        got = ray.get(handle.__ray_call__.remote(_routers_in_process), timeout=60)
        merged["num_routers"] += got["num_routers"]
        merged["times_us"] += got["times_us"]
        add_counts(merged["counts"], got["counts"])
        add_counts(merged["given_up"], got["given_up"])
    return merged


def since(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    """Router records of the measured run alone (the warm-up's taken out)."""
    def new(key: str) -> Dict[str, int]:
        counts = {k: n - before[key].get(k, 0) for k, n in after[key].items()}
        return {k: n for k, n in counts.items() if n}

    return {"num_routers": after["num_routers"], "times_us": after["times_us"][
        len(before["times_us"]):], "counts": new("counts"), "given_up": new("given_up")}


async def warm_up(endpoint: Endpoint) -> None:
    """A few short requests, so no measured request pays for first-call costs."""
    from openai import AsyncOpenAI

    vocab_size = endpoint.vocab_size
    low = min(MIN_PROMPT_TOKEN_ID, vocab_size // 2)
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0,
                           timeout=300) as client:
        await asyncio.gather(*(client.completions.create(
            model=endpoint.model, prompt=[low + (i * 31 + j) % (vocab_size - low)
                                          for j in range(WARMUP_PROMPT_TOKENS)],
            max_tokens=WARMUP_MAX_TOKENS, temperature=0.0)
            for i in range(endpoint.num_warmup_requests)))
    await asyncio.sleep(1.5)  # routing stats reach the router (3 periods of 0.5 s)


def run_router(router: str, config: Any, endpoint: Endpoint, requests: Sequence[BenchRequest],
               label: str = "") -> RunResult:
    """Deploy the application with ``router``, warm it up, replay ``requests``, tear it down."""
    from ray import serve

    from cluster.metrics import kill_metrics_store

    label = label or router
    log(f"[{label}] deploying {config.min_groups} groups x TP {config.engine.tp_size}")
    serve.run(build_bench_app(config, router), name=APP_NAME, route_prefix="/")
    try:
        asyncio.run(warm_up(endpoint))
        before = read_router_stats()
        load_start = load_average()
        log(f"[{label}] replaying {len(requests)} requests (load average {load_start})")
        cpu_before = cpu_snapshot()
        run = asyncio.run(replay(endpoint.base_url, endpoint.model, requests, router,
                                 endpoint.max_duration_s, endpoint.drain_timeout_s,
                                 endpoint.request_timeout_s))
        run.other_cpu_frac = other_cpu_frac(cpu_before, cpu_snapshot())
        run.load_avg = [load_start, load_average()]
        if run.other_cpu_frac is not None and run.other_cpu_frac > OTHER_CPU_WARN_FRAC:
            log(f"[{label}] WARNING: other processes used {run.other_cpu_frac:.0%} of the "
                f"machine's CPU during this run; its figures are not comparable")
        run.router_stats = since(before, read_router_stats())
        if (run.router_stats["num_routers"] > 0) != router.startswith("kv"):
            raise RuntimeError(f"[{label}] found {run.router_stats['num_routers']} KV-aware "
                               f"routers in the ingress: the router swap did not take effect")
    finally:
        serve.delete(APP_NAME)
        kill_metrics_store()
    return run
