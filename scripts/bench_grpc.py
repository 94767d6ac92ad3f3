"""Benchmark the gRPC API against the HTTP API: the same short greedy completions, the same server.

Starts ``tpserve serve`` (the CLI, as a user does: ``--grpc-port`` on) on a local Ray, or uses a
running server (``--url`` and ``--grpc-target``). Then, in ``--rounds`` rounds that alternate the
protocols (so that drift in the machine's load hits both alike), sends ``--requests`` requests per
protocol, ``--concurrency`` at a time, each a text prompt from a small fixed set, greedy,
``--max-tokens`` tokens with ``ignore_eos``: over HTTP ``POST /v1/completions`` with one
keep-alive ``aiohttp`` session, over gRPC ``tpserve.v1.TPServe/Complete`` with one ``grpc.aio``
channel. Per protocol: requests per second (requests over the summed wall time of its rounds) and
the p50 / p99 end-to-end latency. Every gRPC text must equal the HTTP text for the same prompt
(greedy); mismatches are counted.

Prints one line per protocol, the gRPC/HTTP ratios, and last one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]

from cluster.ports import free_port  # noqa: E402

PROMPTS = ("The capital of France is", "Tensor parallelism splits", "Hello, my name is",
           "The quick brown fox", "A paged KV cache stores", "Ray Serve routes each request")
READY_TIMEOUT_S = 300
Send = Callable[[str], Awaitable[str]]



def start_server(model: str, port: int, grpc_port: int, api_key: str) -> subprocess.Popen:
    """``tpserve serve`` in a new process group; ready once ``/v1/models`` answers."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "cluster.cli.main", "serve", "--model", model, "--port",
               str(port), "--grpc-port", str(grpc_port), "--api-key", api_key]
    proc = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tpserve serve exited {proc.returncode}: "
                               f"{proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(request, timeout=5):
                return proc
        except OSError:
            time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"tpserve serve was not ready after {READY_TIMEOUT_S} s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (the CLI then shuts Serve and its Ray down), SIGKILL if it hangs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def http_sender(session: Any, url: str, api_key: str, model: str, max_tokens: int) -> Send:
    async def send(prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {api_key}"}) as resp:
            payload = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {payload}")
            return payload["choices"][0]["text"]
    return send


def grpc_sender(stub: Any, api_key: str, model: str, max_tokens: int) -> Send:
    from cluster.proto.tpserve.v1 import tpserve_pb2 as pb

    metadata = (("authorization", f"Bearer {api_key}"),)

    async def send(prompt: str) -> str:
        request = pb.CompletionRequest(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, ignore_eos=True)
        return (await stub.Complete(request, metadata=metadata, timeout=120)).text
    return send


async def run_round(send: Send, num_requests: int, concurrency: int
                    ) -> Tuple[float, List[float], Dict[str, str]]:
    """(wall seconds, each request's latency, text per prompt) of ``num_requests`` requests."""
    latencies: List[float] = []
    texts: Dict[str, str] = {}
    next_index = iter(range(num_requests))

    async def worker() -> None:
        for i in next_index:
            prompt = PROMPTS[i % len(PROMPTS)]
            started = time.perf_counter()
            texts[prompt] = await send(prompt)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, texts


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(walls: Sequence[float], latencies: Sequence[float]) -> Dict[str, float]:
    return {"requests": len(latencies), "requests_per_s": round(len(latencies) / sum(walls), 2),
            "p50_ms": round(percentile(latencies, 0.50) * 1e3, 1),
            "p99_ms": round(percentile(latencies, 0.99) * 1e3, 1)}


async def compare(args: argparse.Namespace, url: str, grpc_target: str) -> Dict[str, Any]:
    import aiohttp
    import grpc

    from cluster.proto.tpserve.v1 import tpserve_pb2_grpc as pb_grpc

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session, \
            grpc.aio.insecure_channel(grpc_target) as channel:
        senders = {"http": http_sender(session, url, args.api_key, args.served_name,
                                       args.max_tokens),
                   "grpc": grpc_sender(pb_grpc.TPServeStub(channel), args.api_key,
                                       args.served_name, args.max_tokens)}
        for send in senders.values():  # warm-up: connections, the engine's first steps
            await run_round(send, 2 * args.concurrency, args.concurrency)
        walls: Dict[str, List[float]] = {name: [] for name in senders}
        latencies: Dict[str, List[float]] = {name: [] for name in senders}
        texts: Dict[str, Dict[str, str]] = {name: {} for name in senders}
        for index in range(args.rounds):
            order = list(senders) if index % 2 == 0 else list(reversed(senders))
            for name in order:
                wall, lat, seen = await run_round(senders[name], args.requests // args.rounds,
                                                  args.concurrency)
                walls[name].append(wall)
                latencies[name].extend(lat)
                texts[name].update(seen)
    mismatches = sum(texts["grpc"][p] != texts["http"].get(p) for p in texts["grpc"])
    return {name: summary(walls[name], latencies[name]) for name in senders} | {
        "text_mismatches": mismatches}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--served-name", default=None,
                        help="model name in requests (default: the checkpoint directory's)")
    parser.add_argument("--url", default=None, help="a running server's HTTP base URL")
    parser.add_argument("--grpc-target", default=None, help="a running server's host:port")
    parser.add_argument("--api-key", default="bench-key")
    parser.add_argument("--requests", type=int, default=240, help="per protocol (default 240)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument("--concurrency", type=int, default=4, help="in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=4, help="per request (default 4)")
    args = parser.parse_args(argv)
    if args.served_name is None:
        from workers.default_model import resolve_model_path

        args.served_name = resolve_model_path(args.model).name
    proc = None
    url, grpc_target = args.url, args.grpc_target
    if url is None:
        port, grpc_port = free_port(), free_port()
        proc = start_server(args.model, port, grpc_port, args.api_key)
        url, grpc_target = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    try:
        load = os.getloadavg()[0]
        result = asyncio.run(compare(args, url, grpc_target))
    finally:
        if proc is not None:
            stop_server(proc)
    http_run, grpc_run = result["http"], result["grpc"]
    for name, run in (("HTTP", http_run), ("gRPC", grpc_run)):
        print(f"{name}: {run['requests_per_s']} requests/s, p50 {run['p50_ms']} ms, "
              f"p99 {run['p99_ms']} ms ({run['requests']} requests)")
    result["rps_ratio"] = round(grpc_run["requests_per_s"] / http_run["requests_per_s"], 3)
    result["p50_ratio"] = round(grpc_run["p50_ms"] / http_run["p50_ms"], 3)
    result.update(load_avg_before=round(load, 2), concurrency=args.concurrency,
                  max_tokens=args.max_tokens, model=args.served_name)
    print(f"gRPC / HTTP: {result['rps_ratio']}x requests/s, {result['p50_ratio']}x p50 latency; "
          f"{result['text_mismatches']} text mismatches; load average {load:.2f} before")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
