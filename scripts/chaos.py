"""Chaos under load: no request lost while ranks die, hang, and the endpoint is flooded.

    .venv/bin/python -m scripts.chaos [--model default] [--tp 3] [--groups 2] [--dtype float32]

Starts a local Ray and tpserve's Serve application (``cluster.app.build_app``, the code of
``tpserve serve --groups 2 --tp 3 --dtype float32``; the default model, SmolLM2-135M, has 9
attention heads; fp32, in which a greedy output does not depend on the batch it ran in), takes
each prompt's greedy reference from the idle server, then drives steady streaming load with the
``openai`` client (``--clients`` loops of greedy requests over the same prompts) and meanwhile:

1. SIGKILLs rank 1 of one group (its requests migrate to the other group, or wait for the
   replacement);
2. SIGSTOPs the last rank of a group for 3 step timeouts (the hung-rank watchdog must fail the
   group; its requests migrate);
3. floods the endpoint for ``--flood-s`` seconds with 10x the request rate the load achieved,
   short non-streaming requests sent open-loop; the queues are sized for this host
   (``--max-ongoing`` per group, ``--max-queued`` in the ingress), so the flood goes past them:
   429 (or 503) with ``Retry-After``, not a queue that grows.

Every streamed output is compared with its prompt's reference. Prints the counts and, last, one
JSON line: ``requests``, ``completed``, ``migrated`` (from ``/metrics``), ``rejected_429_503``,
``failed_other``, ``wrong_outputs``, ``max_rss_mb`` (the peak of the summed RSS of every process
of the run: Ray's, the replicas', the ranks'), and the timeline. Targets: ``failed_other`` = 0 and
``wrong_outputs`` = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import psutil


from cluster.ports import free_port  # noqa: E402

APP = "tpserve"


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    rejected: int = 0  # 429 or 503 (with Retry-After): said no before falling over
    failed_other: int = 0
    wrong_outputs: int = 0
    errors: List[str] = field(default_factory=list)
    timeline: List[str] = field(default_factory=list)

    def note(self, started: float, what: str) -> None:
        line = f"{time.monotonic() - started:7.1f} s  {what}"
        self.timeline.append(line)
        print(line, flush=True)



def start_app(args: argparse.Namespace, port: int) -> None:
    import ray
    from ray import serve

    from cluster.app import ServeConfig, build_app
    from cluster.cli.serve import use_serve_transport
    from workers.config import EngineConfig

    use_serve_transport()  # the transport `tpserve serve` gives its local Ray
    # Logical CPUs beyond the cores: a replacement group starts while the failed one stops.
    ray.init(address="local", num_cpus=args.num_cpus, _node_ip_address="127.0.0.1",
             include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = EngineConfig(model=args.model, tp_size=args.tp, block_size=16, dtype=args.dtype,
                          num_kv_blocks=args.kv_blocks, step_timeout_s=args.step_timeout_s)
    # Queues sized for a small CPU host, so that the flood goes past them (429) rather than
    # waiting minutes in them; the defaults follow the KV pool (hundreds of requests a group).
    # One ingress: the flood is sized against one replica's limits (--max-queued).
    config = ServeConfig(engine=engine, min_groups=args.groups, max_groups=args.groups,
                         ingress_replicas="1",
                         served_model_name="chaos", max_ongoing_requests=args.max_ongoing,
                         max_queued_requests=args.max_queued)
    serve.run(build_app(config, ray.cluster_resources()), name=APP, route_prefix="/")


def group_ranks() -> Dict[str, List[int]]:
    """Each live group's rank pids, rank 0 first (what `tpserve status` shows)."""
    from cluster.cli.status import collect_status

    report = collect_status()
    return {g["replica"]: [r["pid"] for r in g["ranks"]] for g in report["groups"]
            if g.get("ranks")}


def signal_rank(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # Ray killed it already (its group was replaced)


class RssWatch:
    """The peak of the summed RSS of this process and all its descendants, sampled each second."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(1.0):
            total = 0
            for proc in [me] + me.children(recursive=True):
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_mb = max(self.peak_mb, total / 2**20)

    def stop(self) -> None:
        self._stop.set()


# ----- load -----


def make_prompts(num: int, vocab: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 40))] for _ in range(num)]


GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


async def references(client, prompts: List[List[int]], max_tokens: int) -> List[str]:
    """Each prompt's greedy text from the idle server, before anything fails."""
    outs = []
    for prompt in prompts:
        out = await client.completions.create(model="chaos", prompt=prompt,
                                              max_tokens=max_tokens, **GREEDY)
        outs.append(out.choices[0].text)
    return outs


async def streamed_text(client, prompt: List[int], max_tokens: int) -> str:
    stream = await client.completions.create(model="chaos", prompt=prompt, max_tokens=max_tokens,
                                             stream=True, **GREEDY)
    return "".join([chunk.choices[0].text async for chunk in stream])


async def one_request(client, tally: Tally, prompt: List[int], max_tokens: int,
                      expected: Optional[str]) -> None:
    import openai

    tally.requests += 1
    try:
        if expected is None:  # flood: short, non-streaming, not compared
            await client.completions.create(model="chaos", prompt=prompt, max_tokens=max_tokens,
                                            **GREEDY)
            text = None
        else:
            text = await streamed_text(client, prompt, max_tokens)
    except openai.APIStatusError as exc:
        if exc.status_code in (429, 503):
            tally.rejected += 1
        else:
            tally.failed_other += 1
            tally.errors.append(f"{exc.status_code}: {exc.message[:200]}")
        return
    except Exception as exc:  # noqa: BLE001 - every other way a request can fail is counted
        tally.failed_other += 1
        tally.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        return
    tally.completed += 1
    if expected is not None and text != expected:
        tally.wrong_outputs += 1
        tally.errors.append(f"wrong output: {text[:60]!r} != {expected[:60]!r}")


async def client_loop(client, tally: Tally, prompts, refs, stop: asyncio.Event, max_tokens: int,
                      seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        await one_request(client, tally, prompts[i], max_tokens, refs[i])


async def flood(client, tally: Tally, prompts, rate: float, duration_s: float) -> None:
    """Open loop: ``rate`` requests per second for ``duration_s``, none awaited before the next."""
    tasks, started = [], time.monotonic()
    while time.monotonic() - started < duration_s:
        tasks.append(asyncio.create_task(
            one_request(client, tally, random.choice(prompts), 4, None)))
        await asyncio.sleep(1.0 / rate)
    await asyncio.gather(*tasks)


# ----- the run -----


async def chaos(args: argparse.Namespace, client, tally: Tally, prompts, refs) -> float:
    """Load, a killed rank, a hung rank, a flood; returns the load's request rate before them."""
    stop, started = asyncio.Event(), time.monotonic()
    loops = [asyncio.create_task(client_loop(client, tally, prompts, refs, stop,
                                             args.max_tokens, seed))
             for seed in range(args.clients)]
    await asyncio.sleep(args.warm_s)
    rate = tally.completed / (time.monotonic() - started)
    tally.note(started, f"load: {tally.completed} completed, {rate:.2f} req/s")
    ranks = await asyncio.to_thread(group_ranks)
    groups = sorted(ranks)
    killed = ranks[groups[0]][1]
    signal_rank(killed, signal.SIGKILL)
    tally.note(started, f"SIGKILL rank 1 (pid {killed}) of group {groups[0]}")
    await asyncio.sleep(args.phase_s)
    ranks = await asyncio.to_thread(group_ranks)
    target = next((g for g in sorted(ranks) if killed not in ranks[g]), sorted(ranks)[0])
    hung = ranks[target][-1]
    signal_rank(hung, signal.SIGSTOP)
    tally.note(started, f"SIGSTOP rank {len(ranks[target]) - 1} (pid {hung}) of group {target}")
    await asyncio.sleep(3 * args.step_timeout_s)
    signal_rank(hung, signal.SIGCONT)  # if Ray has not killed it with its group by now
    tally.note(started, "SIGCONT")
    await asyncio.sleep(args.phase_s)
    flood_rate = max(10 * rate, 2.0)
    tally.note(started, f"flood: {flood_rate:.1f} req/s for {args.flood_s:.0f} s")
    await flood(client, tally, prompts, flood_rate, args.flood_s)
    tally.note(started, "flood over; stopping the load")
    stop.set()
    await asyncio.wait_for(asyncio.gather(*loops), timeout=args.drain_s)
    tally.note(started, "load stopped")
    return rate


def migrations(base_url: str) -> int:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(base_url.replace("/v1", "/metrics"), timeout=30).read().decode()
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "tpserve:request_migrations_total"))


def run(args: argparse.Namespace) -> dict:
    import openai
    import ray
    from ray import serve

    from workers.model_config import load_model_config
    from workers.default_model import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    rss = RssWatch()
    tally = Tally()
    try:
        start_app(args, port)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                    timeout=args.request_timeout_s)
        vocab = load_model_config(resolve_model_path(args.model)).vocab_size
        prompts = make_prompts(args.prompts, vocab, args.seed)

        async def main() -> float:
            refs = await references(client, prompts, args.max_tokens)
            return await chaos(args, client, tally, prompts, refs)

        rate = asyncio.run(main())
        migrated = migrations(base_url)
    finally:
        rss.stop()
        serve.shutdown()
        ray.shutdown()
    return {"requests": tally.requests, "completed": tally.completed, "migrated": migrated,
            "rejected_429_503": tally.rejected, "failed_other": tally.failed_other,
            "wrong_outputs": tally.wrong_outputs, "max_rss_mb": round(rss.peak_mb),
            "load_req_s": round(rate, 2), "timeline": tally.timeline,
            "errors": tally.errors[:10]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tp", type=int, default=3)
    # Outputs are checked token for token against the idle server's, which holds in fp32; in
    # bf16 a greedy pick at a near tie follows the batch it ran in.
    p.add_argument("--dtype", default="float32", help="the engine's dtype (default float32)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per rank")
    p.add_argument("--step-timeout-s", type=float, default=10.0)
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--warm-s", type=float, default=20.0, help="load before the first failure")
    p.add_argument("--phase-s", type=float, default=30.0, help="load between the failures")
    p.add_argument("--flood-s", type=float, default=20.0)
    p.add_argument("--drain-s", type=float, default=300.0, help="wait for the last requests")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--max-ongoing", type=int, default=8, help="requests a group holds")
    p.add_argument("--max-queued", type=int, default=8, help="requests the ingress queues")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    result = run(parse_args(argv))
    print(json.dumps(result))
    return 0 if result["failed_other"] == 0 and result["wrong_outputs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
