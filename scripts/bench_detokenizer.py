#!/usr/bin/env python3
"""Time the incremental detokenizer (``workers.detokenizer``) per output token at several output
lengths: today's bounded window against the one before it (``ReferenceDetokenizer``, whose
window grew over tokens that decode to nothing), in the same run.

    PYTHONPATH=$PWD .venv/bin/python -m scripts.bench_detokenizer [--lengths 100,1000,4000]

Workloads, each an output of N tokens after a prompt, on the test checkpoints' byte-level BPE
tokenizer: ``text`` (ordinary text), ``special`` (ten text tokens, then end-of-sequence tokens,
which decoding skips: a request with ``ignore_eos``), ``bytes`` (ten text tokens, then lone bytes
that make no character). Per workload and length: microseconds per token for both, their ratio
and the longest window each decoded. Both must give the same text. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from scripts.gpu.models import save_tokenizer  # noqa: E402
from workers.detokenizer import IncrementalDetokenizer  # noqa: E402
from workers.tokenizer import load_tokenizer  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog"
TEXT = "Hello world, this is a test of streaming text. The quick brown fox jumps again. "
WORKLOADS = ("text", "special", "bytes")


class ReferenceDetokenizer(IncrementalDetokenizer):
    """The detokenizer as it was before its window was bounded: special tokens enter the window
    and the prefix offset moves only when text is emitted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skipped_ids = frozenset()

    def _decode_new(self, hold_incomplete: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith("\ufffd")):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]


def output_ids(tokenizer, workload: str, length: int) -> List[int]:
    text_ids = tokenizer.encode(TEXT * (length // 10 + 1))
    if workload == "text":
        return text_ids[:length]
    if workload == "special":
        filler = tokenizer.eos_token_id
    else:  # a byte that neither starts nor continues a character: each decodes to U+FFFD
        filler = next(i for i in range(len(tokenizer))
                      if tokenizer.decode([i, i]) == "\ufffd\ufffd")
    return text_ids[:10] + [filler] * (length - 10)


def time_one(cls, tokenizer, prompt_ids: List[int], ids: List[int]) -> Dict[str, object]:
    """Microseconds per token over enough repetitions for about 4,000 tokens; the text; the
    longest window."""
    repeats = max(1, 4000 // len(ids))
    start = time.perf_counter()
    for _ in range(repeats):
        detok = cls(tokenizer, prompt_ids)
        for token_id in ids:
            detok.add_token(token_id)
        detok.flush()
    us = (time.perf_counter() - start) / (repeats * len(ids)) * 1e6
    detok, window = cls(tokenizer, prompt_ids), 0
    for token_id in ids:
        window = max(window, detok.num_window_ids)
        detok.add_token(token_id)
    detok.flush()
    return {"us_per_token": us, "text": detok.text, "max_window": window}


def parse_lengths(text: str) -> List[int]:
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 20:
        raise SystemExit(f"--lengths: expected output lengths of at least 20 tokens, "
                         f"comma-separated (100,1000,4000), got {text!r}")
    return lengths


def parse_workloads(text: str) -> List[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {', '.join(unknown)}; expected some of "
                         f"{', '.join(WORKLOADS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="100,1000,4000")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    lengths, workloads = parse_lengths(args.lengths), parse_workloads(args.workloads)
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(Path(tmp))
        tokenizer = load_tokenizer(Path(tmp))
    prompt_ids = tokenizer.encode(PROMPT)
    for workload in workloads:
        results[workload] = {}
        for length in lengths:
            ids = output_ids(tokenizer, workload, length)
            old = time_one(ReferenceDetokenizer, tokenizer, prompt_ids, ids)
            new = time_one(IncrementalDetokenizer, tokenizer, prompt_ids, ids)
            if old["text"] != new["text"]:
                raise SystemExit(f"{workload}, {length} tokens: the texts differ")
            ratio = old["us_per_token"] / new["us_per_token"]
            results[workload][str(length)] = {
                "old_us": round(old["us_per_token"], 2), "new_us": round(new["us_per_token"], 2),
                "ratio": round(ratio, 2), "old_window": old["max_window"],
                "new_window": new["max_window"]}
            print(f"{workload:8s} {length:5d} tokens: old {old['us_per_token']:8.1f} us/token "
                  f"(window {old['max_window']}), new {new['us_per_token']:6.1f} us/token "
                  f"(window {new['max_window']}), old/new {ratio:.2f}x", flush=True)
    print(json.dumps({"workloads": results}))


if __name__ == "__main__":
    main()
