"""scripts/traces.py: the Azure CSV and Mooncake JSONL readers (their errors name the file and the
line), format detection, and what the benchmarks derive from hash ids (conversations and their
sampling, the ideal hit rate, token blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_scripts import load_script

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.fixture(scope="module")
def traces():
    return load_script("traces")


def write_azure(path: Path, rows) -> Path:
    lines = [f"2023-11-16 18:17:0{i}.5000000,{c},{g}\n" for i, (c, g) in enumerate(rows)]
    path.write_text(AZURE_HEADER + "".join(lines))
    return path


def write_mooncake(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                        "hash_ids": h}) + "\n" for t, n, o, h in rows))
    return path


def request(traces, hash_ids, output: int = 1):
    return traces.TraceRequest(0.0, 512 * len(hash_ids), output, tuple(hash_ids))


# ----- reading -----


@pytest.mark.parametrize("text, expected", [
    ("", "expected an Azure CSV with the header"),
    ("time,prompt,output\n1,2,3\n", "expected an Azure CSV with the header"),
    (AZURE_HEADER + "2023-11-16 18:17:03.97,many,3\n", "line 2: expected a timestamp"),
    (AZURE_HEADER + "2023-11-16,5,3\n", "line 2: expected a timestamp"),
    (AZURE_HEADER + "2023-11-16 18:17:03.97,5,-3\n", "line 2: token counts must not be negative"),
    (AZURE_HEADER + "2023-11-16 18:17:03.97,5,3\n", "has 1 requests, fewer than the 2"),
])
def test_read_azure_errors_name_the_file(traces, tmp_path, text, expected):
    trace = tmp_path / "bad.csv"
    trace.write_text(text)
    with pytest.raises(traces.TraceError, match=expected) as info:
        traces.read_azure(trace, 2)
    assert str(trace) in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("", "no requests"),
    ("not json\n", "line 1: expected a JSON object"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 3}\n', "hash_ids"),
    ('\n{"timestamp": 0, "input_length": 5, "output_length": 3, "hash_ids": []}\n',
     "line 2: hash_ids must be a non-empty list"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [1]}\n',
     "output_length must be a positive integer"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 3, "hash_ids": [1]}\n',
     "input_length must be a positive integer"),
    ('{"timestamp": "now", "input_length": 5, "output_length": 3, "hash_ids": [1]}\n',
     "timestamp must be a number"),
])
def test_read_mooncake_errors_name_the_file(traces, tmp_path, text, expected):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(text)
    with pytest.raises(traces.TraceError, match=expected) as info:
        traces.read_mooncake(trace)
    assert str(trace) in str(info.value)


def test_missing_or_binary_trace_names_the_file(traces, tmp_path):
    for read in (traces.read_azure, traces.read_mooncake, traces.read_trace):
        with pytest.raises(traces.TraceError, match="absent.csv: cannot read"):
            read(tmp_path / "absent.csv", 1)
    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 8)
    with pytest.raises(traces.TraceError, match="binary.bin: not a text file"):
        traces.read_trace(binary, 1)


def test_formats_are_detected_and_times_start_at_zero(traces, tmp_path):
    fmt, rows = traces.read_trace(write_azure(tmp_path / "a.csv", [(160, 5), (32, 40)]), 2)
    assert fmt == "azure"
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in rows] == [(160, 5), (32, 40)]
    assert rows[0].arrival_s == 0.0 and rows[1].arrival_s == pytest.approx(1.0)
    fmt, rows = traces.read_trace(write_mooncake(tmp_path / "m.jsonl", [
        (1000, 1024, 3, [7, 8]), (3500, 600, 9, [7, 9])]), 2)
    assert fmt == "mooncake"
    assert rows[1].arrival_s == pytest.approx(2.5) and rows[1].hash_ids == (7, 9)


def test_readers_take_the_first_rows_and_leave_the_rest_unread(traces, tmp_path):
    trace = write_azure(tmp_path / "t.csv", [(80, 3), (0, 0), (5, 9)])
    with open(trace, "a") as f:
        f.write("not,a,row\n")  # past the rows asked for: never parsed
    rows = traces.read_azure(trace, 2)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in rows] == [(80, 3), (0, 0)]
    trace = write_mooncake(tmp_path / "m.jsonl", [(0, 512, 1, [1]), (5, 512, 2, [2])])
    assert [r.hash_ids for r in traces.read_mooncake(trace)] == [(1,), (2,)]
    assert [r.hash_ids for r in traces.read_mooncake(trace, 1)] == [(1,)]


# ----- hash ids -----


def turn(traces, hash_ids, partial: bool = True):
    """A request over ``hash_ids`` whose last block is partial (as a conversation turn's is)."""
    return traces.TraceRequest(0.0, 512 * len(hash_ids) - (100 if partial else 0), 1,
                               tuple(hash_ids))


def shared_root_trace(traces):
    """Every request starts with block 0 (a shared system prompt); three conversations of
    3, 2 and 1 turns, interleaved; each turn extends the previous one's full blocks."""
    return [turn(traces, h) for h in [
        (0, 10, 11), (0, 20, 21), (0, 10, 11, 12), (0, 30), (0, 20, 21, 22, 23),
        (0, 10, 11, 12, 13, 14)]]


def test_conversations_chain_by_full_blocks_not_by_a_shared_root(traces):
    rows = shared_root_trace(traces)
    assert traces.conversation_ids(rows) == [0, 1, 0, 3, 1, 0]
    # A turn's partial last block is not part of the next turn's prefix ...
    partial = [turn(traces, (5, 6)), turn(traces, (5, 7, 8))]
    assert traces.conversation_ids(partial) == [0, 0]
    # ... but a full one is: only a request that extends every full block continues it.
    full = [turn(traces, (5, 6), partial=False), turn(traces, (5, 7, 8))]
    assert traces.conversation_ids(full) == [0, 1]


def test_sample_keeps_whole_conversations_and_respects_n(traces):
    rows = shared_root_trace(traces)
    ids = traces.conversation_ids(rows)
    for seed in range(6):
        for n in (1, 2, 3, 4, 5, 6):
            subset = traces.sample_conversations(rows, seed, num_requests=n)
            assert len(subset) == n
            kept = [i for i, r in enumerate(rows) if r in subset]
            assert subset == [rows[i] for i in kept]  # trace order
            whole = [c for c in set(ids[i] for i in kept)
                     if ids.count(c) == sum(ids[i] == c for i in kept)]
            assert len(set(ids[i] for i in kept)) - len(whole) <= 1  # at most one cut short
            for i in kept:  # a cut conversation lost only later turns
                assert all(j in kept for j in range(i) if ids[j] == ids[i])
    # sizes 3, 2, 1: 3 requests fit whole conversations in every order
    for seed in range(6):
        subset = traces.sample_conversations(rows, seed, num_requests=3)
        kept_ids = [ids[rows.index(r)] for r in subset]
        assert all(kept_ids.count(c) == ids.count(c) for c in kept_ids)
    assert traces.sample_conversations(rows, 0, num_requests=100) == rows


def test_sample_min_turns_keeps_only_conversations_that_long(traces):
    rows = shared_root_trace(traces)  # conversations of 3, 2 and 1 turns
    ids = traces.conversation_ids(rows)
    for seed in range(4):
        subset = traces.sample_conversations(rows, seed, num_requests=5, min_turns=2)
        assert sorted(ids[rows.index(r)] for r in subset) == [0, 0, 0, 1, 1]
    assert [ids[rows.index(r)] for r in
            traces.sample_conversations(rows, 0, frac=1.0, min_turns=3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="no conversation of at least 4 turns"):
        traces.sample_conversations(rows, 0, num_requests=2, min_turns=4)


def test_sample_by_fraction_of_conversations(traces):
    rows = [request(traces, (root, 100 + i)) for i, root in enumerate([1, 2, 1, 3, 2, 1])]
    assert len(set(traces.conversation_ids(rows))) == 6  # full single blocks: none extends
    assert len(traces.sample_conversations(rows, 0, frac=0.5)) == 3
    assert traces.sample_conversations(rows, 0, frac=1.0) == rows
    with pytest.raises(ValueError, match="exactly one"):
        traces.sample_conversations(rows, 0)


def test_ideal_hit_rate_counts_whole_prefixes(traces):
    rows = [request(traces, h) for h in [(1, 2, 3), (1, 2, 4), (5, 2, 3), (1, 2, 3)]]
    # Hits: 0, then 1 and 2 (of 1,2,4), none for 5,2,3 (another prefix), then all 3 (engine: 2).
    assert traces.ideal_hit_rate(rows) == (5 / 12, 4 / 12)


@pytest.mark.parametrize("seed", [None, 3])
def test_block_tokens_are_deterministic_and_in_range(traces, seed):
    tokens = traces.BlockTokens(block_size=4, vocab_size=50, low=3, seed=seed)
    prompt = tokens.prompt([7, 9, 7])
    assert len(prompt) == 12 and prompt[:4] == prompt[8:] and prompt[:4] != prompt[4:8]
    assert all(3 <= t < 50 for t in prompt)
    assert traces.BlockTokens(4, 50, 3, seed).prompt([7]) == prompt[:4]


def test_block_tokens_depend_on_the_seed(traces):
    assert (traces.BlockTokens(8, 1000, 3, seed=1).prompt([7])
            != traces.BlockTokens(8, 1000, 3, seed=2).prompt([7]))
