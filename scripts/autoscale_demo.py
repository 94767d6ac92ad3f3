"""The autoscaled endpoint, shown: `--groups 1:3` scaling on KV load on a local Ray.

    .venv/bin/python -m scripts.autoscale_demo [--model default] [--plot autoscale.png]

Starts a local Ray and tpserve's Serve application (`cluster.app.build_app`, the same code as
`tpserve serve --groups 1:3`), then:

1. load: `--streams` clients send long requests back to back (random token-id prompts, so no
   prefix-cache hits; `ignore_eos`, so each holds its KV blocks for its whole length). The KV
   usage of the first group passes the 70% target, the policy (`cluster.groups.autoscaling`) asks for
   more groups and Serve starts them.
2. trickle: the load stops but one client keeps sending short requests, so that groups are
   scaled down while requests are in flight: any request a draining group dropped would count as
   failed.
3. done when the deployment is back at its minimum (or at `--max-duration-s`).

Every `--sample-s` it records how many group replicas Serve runs (RUNNING: engine built, serving)
and prints it; last it prints one JSON line: `min_groups_seen`, `max_groups_seen`, `scale_up_s`
(load start to the second group serving), `scale_down_s` (load end to back at the minimum),
requests ok/failed, and the samples. `--plot` writes a PNG of the group count over time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple


APP = "tpserve"


@dataclass
class Counts:
    ok: int = 0
    failed: int = 0
    errors: List[str] = field(default_factory=list)


def client_loop(client, stop: threading.Event, counts: Counts, seed: int, prompt_len: int,
                max_tokens: int, vocab: int) -> None:
    """Send requests back to back until `stop`; a request is never cancelled, only awaited."""
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        try:
            out = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                            temperature=0.0, extra_body={"ignore_eos": True})
            if out.usage.completion_tokens == max_tokens:
                counts.ok += 1
            else:
                counts.failed += 1
                counts.errors.append(f"short: {out.usage.completion_tokens}")
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            counts.failed += 1
            counts.errors.append(repr(exc)[:300])


def running_groups() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or "TPGroup" not in app.deployments:
        return 0
    return int(app.deployments["TPGroup"].replica_states.get("RUNNING", 0))


def start_clients(client, n: int, counts: Counts, seed: int, args, prompt_len: int,
                  max_tokens: int) -> Tuple[threading.Event, List[threading.Thread]]:
    stop = threading.Event()
    threads = [threading.Thread(target=client_loop, daemon=True, args=(
        client, stop, counts, seed + k, prompt_len, max_tokens, args.vocab)) for k in range(n)]
    for thread in threads:
        thread.start()
    return stop, threads


def run(args: argparse.Namespace) -> dict:
    import openai
    import ray
    from ray import serve

    from cluster.app import ServeConfig, build_app
    from cluster.cli.serve import use_serve_transport
    from cluster.ports import free_port
    from workers.config import EngineConfig

    use_serve_transport()  # the transport `tpserve serve` gives its local Ray
    ray.init(address="local", num_cpus=args.num_cpus, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = EngineConfig(model=args.model, tp_size=args.tp, block_size=args.block_size,
                          num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len)
    # The groups' autoscaling is what it shows: one ingress replica.
    config = ServeConfig(engine=engine, min_groups=1, max_groups=args.max_groups,
                         ingress_replicas="1",
                         served_model_name="demo", upscale_delay_s=args.upscale_delay_s,
                         downscale_delay_s=args.downscale_delay_s,
                         autoscale_look_back_s=args.look_back_s)
    serve.run(build_app(config, ray.cluster_resources()), name=APP, route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=600)
    samples: List[Tuple[float, int]] = []
    t0 = time.monotonic()

    def sample(phase: str) -> int:
        count = running_groups()
        samples.append((round(time.monotonic() - t0, 2), count))
        print(f"t={samples[-1][0]:7.1f}s  {phase:8s} groups={count}", flush=True)
        return count

    counts = Counts()
    load_start = time.monotonic()
    stop, threads = start_clients(client, args.streams, counts, 1, args, args.prompt_len,
                                  args.max_tokens)
    scale_up_s: Optional[float] = None
    while time.monotonic() - load_start < args.load_s:
        if sample("load") >= 2 and scale_up_s is None:
            scale_up_s = time.monotonic() - load_start
        if scale_up_s is not None and time.monotonic() - load_start > scale_up_s + args.hold_s:
            break
        time.sleep(args.sample_s)
    stop.set()
    load_end = time.monotonic()
    trickle_stop, trickle = start_clients(client, 1, counts, 1000, args, 8, 8)
    scale_down_s: Optional[float] = None
    deadline = t0 + args.max_duration_s
    while time.monotonic() < deadline:
        if sample("drain") <= 1 and max(c for _, c in samples) > 1:
            scale_down_s = time.monotonic() - load_end
            break
        time.sleep(args.sample_s)
    trickle_stop.set()
    for thread in threads + trickle:
        thread.join(timeout=600)
    sample("end")
    counts_seen = [c for _, c in samples if c > 0]
    return {
        "min_groups_seen": min(counts_seen), "max_groups_seen": max(counts_seen),
        "scale_up_s": None if scale_up_s is None else round(scale_up_s, 1),
        "scale_down_s": None if scale_down_s is None else round(scale_down_s, 1),
        "load_end_s": round(load_end - t0, 1),
        "requests_ok": counts.ok, "requests_failed": counts.failed,
        "errors": counts.errors[:5], "samples": samples,
        "config": {"model": args.model, "tp": args.tp, "groups": f"1:{args.max_groups}",
                   "kv_blocks": args.kv_blocks, "block_size": args.block_size,
                   "streams": args.streams, "prompt_len": args.prompt_len,
                   "max_tokens": args.max_tokens, "look_back_s": args.look_back_s,
                   "upscale_delay_s": args.upscale_delay_s,
                   "downscale_delay_s": args.downscale_delay_s},
        "load_average": os.getloadavg()[0],
    }


def plot(samples: List[Tuple[float, int]], path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.step([t for t, _ in samples], [c for _, c in samples], where="post")
    ax.axvline(0, color="grey", linestyle=":")
    ax.axvline(result["load_end_s"], color="grey", linestyle=":")
    ax.text(result["load_end_s"], 0.2, " load stops", color="grey")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("TP groups serving")
    ax.set_yticks(range(0, result["max_groups_seen"] + 2))
    ax.set_title(f"tpserve --groups {result['config']['groups']}: scale-up "
                 f"{result['scale_up_s']} s, scale-down {result['scale_down_s']} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-groups", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--kv-blocks", type=int, default=48, help="per group (small: KV fills)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--streams", type=int, default=3, help="clients during the load")
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt ids drawn below this")
    parser.add_argument("--load-s", type=float, default=240.0, help="longest load phase")
    parser.add_argument("--hold-s", type=float, default=20.0,
                        help="load kept this long after the second group serves")
    parser.add_argument("--look-back-s", type=float, default=5.0)
    parser.add_argument("--upscale-delay-s", type=float, default=2.0)
    parser.add_argument("--downscale-delay-s", type=float, default=20.0)
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--max-duration-s", type=float, default=540.0)
    parser.add_argument("--plot", default=None, help="write a PNG of groups over time here")
    args = parser.parse_args(argv)
    from ray import serve
    import ray

    try:
        result = run(args)
    finally:
        serve.shutdown()
        from cluster.metrics import kill_metrics_store

        kill_metrics_store()
        ray.shutdown()
    if args.plot:
        plot(result["samples"], args.plot, result)
    print(json.dumps(result))
    return 0 if result["requests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
