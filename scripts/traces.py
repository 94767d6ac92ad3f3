"""Request traces for the benchmark scripts: two file formats read into one row type, and what the
benchmarks derive from a trace alone.

* Azure LLM inference CSV: the header ``TIMESTAMP,ContextTokens,GeneratedTokens``, then one request
  a row (``2023-11-16 18:17:03.9799600,4808,10``). No token contents.
* Mooncake JSONL: one request a line, ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids": [...]}``, one hash id per 512-token prompt block; requests whose hash ids start alike
  share that prompt prefix, and a request whose hash ids extend an earlier one's full blocks is
  that request's next turn (`conversation_ids`). ``BlockTokens`` turns hash ids into token ids
  that keep this sharing.

Every reader raises ``TraceError`` naming the file, the line and what was expected there; a
script prints it without a traceback.
"""

from __future__ import annotations

import csv
import itertools
import json
import random
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, TextIO, Tuple

TRACES_DIR = Path(__file__).resolve().parents[2] / "shared/data/traces"
AZURE_CODE_TRACE = TRACES_DIR / "AzureLLMInferenceTrace_code.csv"
MOONCAKE_SYNTHETIC_TRACE = TRACES_DIR / "mooncake_synthetic_trace.jsonl"
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file that cannot be read, or a row that is not what its format says."""


@dataclass(frozen=True)
class TraceRequest:
    """One trace row: arrival (seconds after the trace's first request), lengths, block ids."""

    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: Tuple[int, ...] = ()  # Mooncake only: one id per 512-token prompt block


# ----- reading -----


def read_trace(path: Path, num_requests: Optional[int] = None) -> Tuple[str, List[TraceRequest]]:
    """``(format, rows)`` of a trace in either format, told apart by its first character ("{":
    "mooncake", otherwise "azure"); the rows as ``read_azure`` / ``read_mooncake`` give them."""
    with _open(path) as f:
        is_mooncake = f.readline().lstrip().startswith("{")
    if is_mooncake:
        return "mooncake", read_mooncake(path, num_requests)
    return "azure", read_azure(path, num_requests)


def read_azure(path: Path, num_requests: Optional[int] = None) -> List[TraceRequest]:
    """The first ``num_requests`` requests (None: all, at least one) of an Azure CSV trace. Token
    counts may be 0 (the benchmarks clamp lengths to at least 1); rows past those asked for are
    not read."""
    return _read(path, _azure_rows, num_requests)


def read_mooncake(path: Path, num_requests: Optional[int] = None) -> List[TraceRequest]:
    """The first ``num_requests`` requests (None: all, at least one) of a Mooncake JSONL trace;
    blank lines are skipped. Every row has positive lengths and at least one hash id."""
    return _read(path, _mooncake_rows, num_requests)


@contextmanager
def _open(path: Path) -> Iterator[TextIO]:
    try:
        with open(path, newline="") as f:
            yield f
    except OSError as exc:
        raise TraceError(f"trace {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {path}: not a text file (expected an Azure CSV or a Mooncake "
                         f"JSONL trace)") from None


def _read(path: Path, rows: Callable[[Path, TextIO], Iterator[TraceRequest]],
          num_requests: Optional[int]) -> List[TraceRequest]:
    with _open(path) as f:
        taken = list(itertools.islice(rows(path, f), num_requests))
    if num_requests is None and not taken:
        raise TraceError(f"trace {path}: no requests")
    if num_requests is not None and len(taken) < num_requests:
        raise TraceError(f"trace {path} has {len(taken)} requests, fewer than the "
                         f"{num_requests} asked for")
    return taken


def _azure_rows(path: Path, f: TextIO) -> Iterator[TraceRequest]:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header[:3]) != AZURE_COLUMNS:
        raise TraceError(f"trace {path}: expected an Azure CSV with the header "
                         f"{','.join(AZURE_COLUMNS)}, got {header}")
    start: Optional[float] = None
    for line, row in enumerate(reader, start=2):
        try:
            stamp = _azure_time(row[0])
            context, generated = int(row[1]), int(row[2])
        except (IndexError, ValueError):
            raise TraceError(f"trace {path} line {line}: expected a timestamp and integer "
                             f"ContextTokens and GeneratedTokens, got {row}") from None
        if context < 0 or generated < 0:
            raise TraceError(f"trace {path} line {line}: token counts must not be negative, "
                             f"got {row}")
        start = stamp if start is None else start
        yield TraceRequest(stamp - start, context, generated)


def _azure_time(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (seven fractional digits) as POSIX seconds."""
    whole, _, frac = text.strip().partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


def _mooncake_rows(path: Path, f: TextIO) -> Iterator[TraceRequest]:
    start: Optional[float] = None
    for line, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or any(k not in obj for k in MOONCAKE_KEYS):
            raise TraceError(f"trace {path} line {line}: expected a JSON object with keys "
                             f"{', '.join(MOONCAKE_KEYS)} (Mooncake), got {text.strip()[:120]!r}")
        problem = _mooncake_problem(obj)
        if problem:
            raise TraceError(f"trace {path} line {line}: {problem}")
        stamp = obj["timestamp"] / 1000.0
        start = stamp if start is None else start
        yield TraceRequest(stamp - start, obj["input_length"], obj["output_length"],
                           tuple(obj["hash_ids"]))


def _mooncake_problem(obj: Dict[str, object]) -> Optional[str]:
    """What is wrong with the values of a Mooncake row that has every key; None: nothing."""
    if not _is_number(obj["timestamp"]):
        return f"timestamp must be a number (milliseconds), got {obj['timestamp']!r}"
    for key in ("input_length", "output_length"):
        if not _is_int(obj[key]) or obj[key] < 1:
            return f"{key} must be a positive integer, got {obj[key]!r}"
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not hash_ids or not all(map(_is_int, hash_ids)):
        return f"hash_ids must be a non-empty list of integers, got {str(hash_ids)[:120]}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


# ----- what a Mooncake trace's hash ids say -----


def conversation_ids(rows: Sequence[TraceRequest]) -> List[int]:
    """Each row's conversation: the index of its conversation's first row.

    A turn's full prompt blocks (``num_prompt_tokens // 512`` of its hash ids; its last, partial
    block changes when the next turn appends to it) are its conversation's key. A row continues
    the conversation whose key is the longest prefix of its hash ids; otherwise it starts one.
    A key counts only if, across the trace, every full block that follows it is the same block:
    a conversation goes on one way, while a shared system prompt or document is followed by the
    different first blocks of many requests. So requests that only share leading blocks are
    separate conversations, also when every request starts with the same block, and a turn whose
    only full blocks are such a shared prefix starts a conversation that later turns cannot join.
    Cost: O(total hash ids), in two passes."""
    keys = [_prefix_keys(row.hash_ids) for row in rows]
    next_blocks: Dict[int, set] = {}
    for row, row_keys in zip(rows, keys):
        for i in range(_num_full_blocks(row) - 1):
            next_blocks.setdefault(row_keys[i], set()).add(row.hash_ids[i + 1])
    by_key: Dict[int, int] = {}
    ids: List[int] = []
    for index, (row, row_keys) in enumerate(zip(rows, keys)):
        parent = next((by_key[k] for k in reversed(row_keys) if k in by_key), index)
        ids.append(parent)
        num_full = _num_full_blocks(row)
        if num_full and len(next_blocks.get(row_keys[num_full - 1], ())) <= 1:
            by_key[row_keys[num_full - 1]] = parent
    return ids


def _num_full_blocks(row: TraceRequest) -> int:
    return min(len(row.hash_ids), row.num_prompt_tokens // MOONCAKE_BLOCK_TOKENS)


def _prefix_keys(hash_ids: Sequence[int]) -> List[int]:
    """One int per prefix of ``hash_ids``, chained (equal prefixes, equal keys)."""
    keys, key = [], 0
    for h in hash_ids:
        key = hash((key, h))
        keys.append(key)
    return keys


def sample_conversations(rows: Sequence[TraceRequest], seed: int,
                         num_requests: Optional[int] = None,
                         frac: Optional[float] = None,
                         min_turns: int = 1) -> List[TraceRequest]:
    """A seeded subset of whole conversations (`conversation_ids`), in trace order.

    Only conversations of at least ``min_turns`` turns take part (multi-turn chat: each turn
    carries the conversation so far); ValueError when there is none. ``frac``: that fraction of
    them (at least one). ``num_requests``: exactly that many requests (all of theirs if they have
    fewer): conversations in a seeded order, each taken whole if it fits in the room left, else
    skipped; if room is left at the end, the first turns of the first skipped conversation fill
    it (a conversation cut after a turn is still a conversation: only later turns are missing).
    One of the two must be given."""
    if (num_requests is None) == (frac is None):
        raise ValueError("sample_conversations: give exactly one of num_requests and frac")
    members: Dict[int, List[int]] = {}
    for index, conversation in enumerate(conversation_ids(rows)):
        members.setdefault(conversation, []).append(index)
    members = {c: turns for c, turns in members.items() if len(turns) >= min_turns}
    if not members:
        raise ValueError(f"sample_conversations: the trace has no conversation of at least "
                         f"{min_turns} turns")
    order = sorted(members)
    random.Random(seed).shuffle(order)
    if frac is not None:
        kept = [i for c in order[:max(1, round(frac * len(order)))] for i in members[c]]
        return [rows[i] for i in sorted(kept)]
    room = min(num_requests, sum(len(turns) for turns in members.values()))
    kept, skipped = [], []
    for conversation in order:
        if len(members[conversation]) <= room - len(kept):
            kept += members[conversation]
        else:
            skipped.append(conversation)
    if len(kept) < room:
        kept += members[skipped[0]][:room - len(kept)]
    return [rows[i] for i in sorted(kept)]


def ideal_hit_rate(rows: Iterable[TraceRequest]) -> Tuple[float, float]:
    """(block hit rate of an infinite cache, the same leaving every prompt's last block to
    compute as the engine does). A block hits if its whole prefix of hash ids was seen before."""
    seen: set = set()
    hits = engine_hits = total = 0
    for r in rows:
        num_hit = 0
        while num_hit < len(r.hash_ids) and r.hash_ids[:num_hit + 1] in seen:
            num_hit += 1
        hits += num_hit
        engine_hits += min(num_hit, len(r.hash_ids) - 1)
        total += len(r.hash_ids)
        seen.update(r.hash_ids[:i + 1] for i in range(len(r.hash_ids)))
    return hits / total, engine_hits / total


class BlockTokens:
    """Hash id -> its block of ``block_size`` token ids in ``[low, vocab_size)``, the same ids
    wherever the id appears, so requests that share hash ids share prompt prefixes. Each block is
    drawn from a generator seeded by ``"{seed}:{hash_id}"`` (``seed`` None: by the hash id alone)
    and kept, so a repeated id costs a lookup."""

    def __init__(self, block_size: int, vocab_size: int, low: int,
                 seed: Optional[int] = None) -> None:
        self.block_size, self.vocab_size, self.low, self.seed = block_size, vocab_size, low, seed
        self._blocks: Dict[int, List[int]] = {}

    def prompt(self, hash_ids: Sequence[int]) -> List[int]:
        return [t for h in hash_ids for t in self.block(h)]

    def block(self, hash_id: int) -> List[int]:
        if hash_id not in self._blocks:
            rng = random.Random(hash_id if self.seed is None else f"{self.seed}:{hash_id}")
            self._blocks[hash_id] = [rng.randrange(self.low, self.vocab_size)
                                     for _ in range(self.block_size)]
        return self._blocks[hash_id]
