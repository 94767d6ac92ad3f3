#!/usr/bin/env python3
"""Time a group's waiting-demand report (``workers.waiting_demand``), taken on the engine thread
after every step, with long queues of conversation turns waiting behind a cached history:
the bounded walk (``WaitingDemand``, at most ``MAX_LOOKUPS`` blocks per report, each request's
walk going on from the last report's) against a full prefix lookup of every waiting request in
every report (what the engine did before; a fresh ``WaitingDemand`` with no limit walks so).

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_load_report [--queues 64x2048,256x2048]

Per queue (N requests of L history tokens + 20 new ones, block size 16): the full walk's time per
report, the bounded walk's first report (also its cost after every eviction, when walks start
over), after how many reports its figure equals the full walk's, and its reports from then on;
their ratios to the full walk. The model is a tiny random Llama: the report does not run it.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple, Union


from scripts.gpu.models import build_checkpoint  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.waiting_demand import MAX_LOOKUPS, WaitingDemand  # noqa: E402

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384)
BLOCK_SIZE = 16


def queue_behind_history(model: Path, num_waiting: int, history_len: int) -> LLMEngine:
    """An engine with ``history_len`` tokens computed and cached and ``num_waiting`` next turns
    of that history waiting (one sequence runs at a time)."""
    config = EngineConfig(model=str(model), block_size=BLOCK_SIZE, max_num_seqs=1,
                          num_kv_blocks=history_len // BLOCK_SIZE + 64)
    engine = LLMEngine(config)
    history = [(7 * i) % 500 + 3 for i in range(history_len)]
    engine.add_request(history, SamplingParams(max_tokens=1), "history")
    while engine.has_unfinished():
        engine.step()
    for k in range(num_waiting):
        engine.add_request(history + [3 + k % 400] * 20, SamplingParams(max_tokens=2), f"w{k}")
    return engine


def time_reports(engine: LLMEngine, num_reports: int) -> Dict[str, Union[int, float]]:
    sched = engine.scheduler
    exact = WaitingDemand(max_lookups=10**9).uncomputed_tokens(sched)
    start = time.perf_counter()
    for _ in range(num_reports):
        WaitingDemand(max_lookups=10**9).uncomputed_tokens(sched)
    full_ms = (time.perf_counter() - start) / num_reports * 1e3
    bounded = WaitingDemand()
    start = time.perf_counter()
    figure, converged = bounded.uncomputed_tokens(sched), 1
    first_ms = (time.perf_counter() - start) * 1e3
    # Each report walks on from the last one's, at least one block further: all the requests'
    # blocks and a miss each bound the reports it takes.
    most = sum(r.num_tokens // sched.kv.block_size + 1 for r in sched.waiting) + 1
    while figure != exact:
        if converged == most:
            raise SystemExit(f"the bounded walk reports {figure} tokens after {most} reports, "
                             f"not {exact}: it does not go on from where it stopped")
        figure, converged = bounded.uncomputed_tokens(sched), converged + 1
    start = time.perf_counter()
    for _ in range(num_reports):
        bounded.uncomputed_tokens(sched)
    later_ms = (time.perf_counter() - start) / num_reports * 1e3
    return {"full_ms": full_ms, "bounded_first_ms": first_ms, "bounded_later_ms": later_ms,
            "exact_tokens": exact, "reports_to_exact": converged}


def parse_queues(text: str) -> List[Tuple[int, int]]:
    try:
        return [(int(n), int(length)) for n, length in (q.split("x") for q in text.split(","))]
    except ValueError:
        raise SystemExit(f"--queues: expected NxL,... (N requests of L history tokens), "
                         f"got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", default="16x512,64x2048,256x2048,64x8192")
    parser.add_argument("--reports", type=int, default=200)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        build_checkpoint(model, SHAPE)
        for num_waiting, history_len in parse_queues(args.queues):
            with queue_behind_history(model, num_waiting, history_len) as engine:
                r = time_reports(engine, args.reports)
            key = f"{num_waiting}x{history_len}"
            results[key] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
            print(f"{num_waiting} waiting, {history_len}-token history: full walk "
                  f"{r['full_ms']:.3f} ms per report; bounded ({MAX_LOOKUPS} blocks) first "
                  f"{r['bounded_first_ms']:.3f} ms ({r['bounded_first_ms'] / r['full_ms']:.2f}x), "
                  f"later {r['bounded_later_ms']:.3f} ms "
                  f"({r['bounded_later_ms'] / r['full_ms']:.3f}x); exact after "
                  f"{r['reports_to_exact']} report(s)", flush=True)
    print(json.dumps({"max_lookups": MAX_LOOKUPS, "block_size": BLOCK_SIZE, "queues": results}))


if __name__ == "__main__":
    main()
