"""The overlapped step loop (``--async-scheduling``) against the serial one on this machine.

One engine runs ``bench_engine.py``'s two workloads (prefill-heavy: Azure code trace requests;
decode-heavy: short prompts, long outputs), every request submitted at once, greedy,
``ignore_eos``, prefix caching off; the loops alternate, the one going first alternating between rounds (after a
warm-up of each). Prints output tok/s per loop and workload and the overlapped / serial ratio
(medians over rounds), checks that both loops produced the same ids, and ends with one JSON line
(``ratio_overlapped_vs_serial_prefill``, ``ratio_overlapped_vs_serial_decode``, ...).

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_step_loop --rounds 3
    # plus bench_engine.py's workload options: --num-requests, --decode-requests, --dtype, ...
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence

from scripts import bench_engine
from workers.config import EngineConfig
from workers.llm import LLM
from scripts.engine.systems import run_tpserve
from scripts.traces import TraceError, read_azure

LOOPS = ("serial", "overlapped")


def parse_args(argv: Optional[Sequence[str]]):
    argv = list(argv if argv is not None else sys.argv[1:])
    rounds = 3
    if "--rounds" in argv:
        at = argv.index("--rounds")
        try:
            rounds = int(argv[at + 1])
        except (IndexError, ValueError):
            raise SystemExit("error: --rounds needs an integer") from None
        del argv[at:at + 2]
    if rounds < 1:
        raise SystemExit(f"error: --rounds must be at least 1, got {rounds}")
    args = bench_engine.parse_args(argv)
    if args.structured:
        raise SystemExit("error: --structured is bench_engine.py's own benchmark; drop it here")
    args.rounds = rounds
    return args


def run(args) -> Dict[str, object]:
    load_start = os.getloadavg()[0]
    rows = read_azure(args.trace, args.num_requests)
    llm = _build_engine(args)
    try:
        engine = llm.engine
        workloads = bench_engine.build_workloads(rows, args, engine.max_model_len,
                                                 engine.model_config.vocab_size)
        rates: Dict[str, Dict[str, List[float]]] = {w.name: {n: [] for n in LOOPS}
                                                    for w in workloads}
        same_ids = True
        for loop in LOOPS:  # warm-up
            engine.async_scheduling = loop == "overlapped"
            run_tpserve(llm, workloads[1])
        for round_index in range(args.rounds):
            for workload in workloads:
                order = LOOPS if round_index % 2 == 0 else LOOPS[::-1]
                outputs = {}
                for loop in order:
                    engine.async_scheduling = loop == "overlapped"
                    result, _ = run_tpserve(llm, workload)
                    outputs[loop] = result.outputs
                    rates[workload.name][loop].append(result.num_output_tokens / result.wall_s)
                    print(f"round {round_index + 1} {workload.name:<14}{loop:<12}"
                          f"{rates[workload.name][loop][-1]:9.1f} tok/s", flush=True)
                same_ids = same_ids and outputs["serial"] == outputs["overlapped"]
    finally:
        llm.shutdown()
    return _summary(rates, same_ids, args, load_start)


def _build_engine(args) -> LLM:
    """Prefix caching off: every run computes the same steps (the rounds repeat the prompts)."""
    try:
        llm = LLM(EngineConfig(model=args.model, tp_size=args.tp, block_size=args.block_size,
                               dtype=args.dtype, enable_prefix_cache=False))
    except (OSError, ValueError) as exc:
        raise bench_engine.BenchInputError(f"--model {args.model} --tp {args.tp} --dtype "
                                           f"{args.dtype}: {exc}") from None
    return llm


def _summary(rates, same_ids: bool, args, load_start: float) -> Dict[str, object]:
    result: Dict[str, object] = {"rounds": args.rounds, "dtype": args.dtype,
                                 "same_ids": same_ids}
    print(f"\n{'workload':<16}{'serial tok/s':>14}{'overlapped':>12}{'ratio':>8}")
    for name, key in (("prefill-heavy", "prefill"), ("decode-heavy", "decode")):
        serial = statistics.median(rates[name]["serial"])
        overlapped = statistics.median(rates[name]["overlapped"])
        print(f"{name:<16}{serial:14.1f}{overlapped:12.1f}{overlapped / serial:8.3f}")
        result.update({f"serial_{key}_tokens_per_s": serial,
                       f"overlapped_{key}_tokens_per_s": overlapped,
                       f"ratio_overlapped_vs_serial_{key}": overlapped / serial})
    print(f"same ids in both loops: {same_ids}")
    result.update(load_average_start=load_start, load_average_end=os.getloadavg()[0])
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (bench_engine.BenchInputError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result["same_ids"] else 1


if __name__ == "__main__":
    sys.exit(main())
