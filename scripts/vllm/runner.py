"""The vLLM side of ``bench_vs_vllm.py``, run by the vLLM virtualenv's python as a file
(``python runner.py --model DIR --dtype D --max-model-len N``); it imports the standard library and
vLLM only, never tpserve.

Protocol, one JSON object a line:

1. It loads the model (``LLM``, prefix caching off, ``VLLM_CPU_KVCACHE_SPACE`` from its parent),
   runs a two-token warm-up and prints ``{"ready": true, "vllm_version", "torch_version", ...}``.
2. For each line read from stdin (the path of a workload file, ``write_workload``'s format) it
   submits every request at once with ``SamplingParams(temperature=0, max_tokens=n,
   ignore_eos=True)`` from the file's token ids and prints ``{"workload", "wall_s",
   "num_output_tokens", "outputs"}``; ``wall_s`` times ``generate`` alone.
3. It exits at end of input.

Only these lines go to stdout: everything else the process writes there (vLLM's logs, native
code) is sent to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, TextIO, Tuple

WORKLOAD_FORMAT = 1


def write_workload(path: Path, name: str, prompts: Sequence[Sequence[int]],
                   max_tokens: Sequence[int]) -> None:
    """One workload as JSON: its name, every prompt's token ids and every request's output
    length, in request order."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"workload {name}: {len(prompts)} prompts but {len(max_tokens)} "
                         "output lengths; expected one output length per prompt")
    doc = {"format": WORKLOAD_FORMAT, "name": name,
           "prompts": [[int(t) for t in p] for p in prompts],
           "max_tokens": [int(n) for n in max_tokens]}
    Path(path).write_text(json.dumps(doc))


def read_workload(path: Path) -> Tuple[str, List[List[int]], List[int]]:
    """``(name, prompts, max_tokens)`` of a file that ``write_workload`` wrote."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != WORKLOAD_FORMAT:
        raise ValueError(f"workload file {path}: format {doc.get('format')!r}, expected "
                         f"{WORKLOAD_FORMAT} (written by scripts/vllm/runner.py write_workload)")
    return doc["name"], doc["prompts"], doc["max_tokens"]


def _results_stream() -> TextIO:
    """A stream on the original stdout; fd 1 (and ``sys.stdout``) then point at stderr, so that
    nothing but ``_emit``'s lines reaches the parent's pipe."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return results


def _emit(stream: TextIO, doc: Dict[str, object]) -> None:
    stream.write(json.dumps(doc) + "\n")
    stream.flush()


def load(args: argparse.Namespace):
    from vllm import LLM

    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
               seed=args.seed, enable_prefix_caching=False, skip_tokenizer_init=True)


def generate(llm, prompts: List[List[int]], max_tokens: List[int]) -> Tuple[float, List[List[int]]]:
    """Every request at once, greedy, exactly ``max_tokens[i]`` new tokens each; the wall time of
    ``generate`` and each request's output token ids, in request order."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in max_tokens]
    requests = [{"prompt_token_ids": p} for p in prompts]
    started = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    return wall_s, [list(o.outputs[0].token_ids) for o in outs]


def _ready(llm) -> Dict[str, object]:
    import torch
    import vllm

    scheduler = llm.llm_engine.vllm_config.scheduler_config
    return {"ready": True, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}


def serve(llm, requests: TextIO, results: TextIO) -> None:
    for line in requests:
        if not line.strip():
            continue
        name, prompts, max_tokens = read_workload(Path(line.strip()))
        wall_s, outputs = generate(llm, prompts, max_tokens)
        _emit(results, {"workload": name, "wall_s": wall_s,
                        "num_output_tokens": sum(len(o) for o in outputs), "outputs": outputs})


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="vLLM side of scripts/bench_vs_vllm.py")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    results = _results_stream()
    llm = load(args)
    generate(llm, [[1, 2, 3, 4]], [2])
    _emit(results, _ready(llm))
    serve(llm, sys.stdin, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
