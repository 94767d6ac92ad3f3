"""Block tables on the device, changed by diffs, and the step metadata built from them: equal to
the metadata built on the host from whole lists (the reference every kernel test uses)."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kv.attention.metadata import SeqSlice
from kv.attention.block_table_metadata import (DeviceSeq, _Packed, build_block_table_metadata,
                                     build_device_step)
from kv.attention.device_block_tables import PADDING_ROW, DeviceBlockTables

CPU = torch.device("cpu")


def test_rows_follow_adds_extends_and_frees():
    tables = DeviceBlockTables(max_blocks_per_seq=4, device=CPU, num_rows=2, padding_block=9)
    tables.add(10, [3, 4])
    tables.add(11, [5])
    tables.extend(10, [6])
    tables.flush()
    assert tables.table[tables.row_of(10), :3].tolist() == [3, 4, 6]
    assert tables.table[tables.row_of(11), :1].tolist() == [5]
    assert tables.table[PADDING_ROW].tolist() == [9, 9, 9, 9]
    row_10 = tables.row_of(10)
    tables.free(10)
    tables.add(12, [7, 8])  # takes the freed row; the staged entries overwrite its old ones
    tables.flush()
    assert tables.row_of(12) == row_10
    assert tables.table[row_10, :2].tolist() == [7, 8]
    assert tables.version == 0


def test_the_table_grows_when_every_row_is_taken_and_keeps_its_rows():
    tables = DeviceBlockTables(max_blocks_per_seq=2, device=CPU, num_rows=1)
    tables.add(0, [1, 2])
    tables.flush()
    tables.add(1, [3])  # no free row: the table doubles, staged entries still land
    tables.add(2, [4])
    tables.flush()
    assert tables.version >= 1 and tables.num_seqs == 3
    assert [tables.table[tables.row_of(s), 0].item() for s in (0, 1, 2)] == [1, 3, 4]
    assert tables.table[tables.row_of(0), 1].item() == 2


def test_a_row_overflow_names_the_sequence():
    tables = DeviceBlockTables(max_blocks_per_seq=2, device=CPU)
    tables.add(5, [1, 2])
    with pytest.raises(ValueError, match="sequence 5 would hold 3 blocks"):
        tables.extend(5, [3])


def test_one_entry_per_position_reaches_the_scatter():
    """A re-added sequence stages the same (row, column) twice in one flush: the last wins."""
    tables = DeviceBlockTables(max_blocks_per_seq=2, device=CPU)
    tables.add(1, [4, 5])
    tables.add(1, [6])  # replaces its row before any flush
    tables.flush()
    assert tables.table[tables.row_of(1), 0].item() == 6


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_seqs = draw(st.integers(1, 6))
    seqs = []
    for _ in range(num_seqs):
        num_computed = draw(st.integers(0, 40))
        query_len = draw(st.integers(1, 9))
        extra = draw(st.integers(0, 2))  # blocks allocated past the context (lookahead)
        num_blocks = -(-(num_computed + query_len) // block_size) + extra
        seqs.append((num_computed, query_len, num_blocks))
    windows = draw(st.sampled_from([[None], [5], [None, 7, None]]))
    return block_size, seqs, windows, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(steps())
def test_device_step_equals_the_host_metadata(step):
    block_size, shapes, windows, seed = step
    rng = random.Random(seed)
    tables = DeviceBlockTables(max_blocks_per_seq=64, device=CPU, num_rows=2)
    slices, device_seqs, input_ids, logit_rows = [], [], [], []
    for seq_id, (num_computed, query_len, num_blocks) in enumerate(shapes):
        block_ids = rng.sample(range(500), num_blocks)
        tables.add(100 + seq_id, block_ids[:1])  # arrives with one block, then grows
        tables.extend(100 + seq_id, block_ids[1:])
        slices.append(SeqSlice(query_len, num_computed, block_ids))
        device_seqs.append(DeviceSeq(tables.row_of(100 + seq_id), query_len, num_computed))
        input_ids.extend(rng.randrange(1000) for _ in range(query_len))
        logit_rows.append(len(input_ids) - 1)
    tables.flush()
    got = build_device_step(tables, device_seqs, input_ids, logit_rows, block_size, windows)
    want = build_block_table_metadata(slices, block_size, CPU, windows)
    assert got.input_ids.tolist() == input_ids and got.logit_rows.tolist() == logit_rows
    for g, w in zip(got.metadata, want):
        for name in ("positions", "slot_mapping", "query_start", "query_len", "context_len",
                     "decode_ids", "prefill_ids", "cached_prefill_ids"):
            assert getattr(g, name).tolist() == getattr(w, name).tolist(), name
        for name in ("num_tokens", "num_decodes", "max_decode_keys", "max_query_len",
                     "fresh_prefills", "sliding_window", "block_size"):
            assert getattr(g, name) == getattr(w, name), name
        for b, s in enumerate(slices):  # the columns a kernel reads: up to the last key
            visible = -(-s.context_len // block_size)
            assert g.block_table[b, :visible].tolist() == w.block_table[b, :visible].tolist()
        assert g.positions.dtype == g.slot_mapping.dtype == torch.long
        assert g.block_table.dtype == g.context_len.dtype == torch.int32


def test_packed_parts_come_back_equal_and_16_byte_aligned():
    # Triton specializes kernels on each pointer's 16-byte alignment: a part at an offset that
    # follows the batch size would compile them again for every new step shape.
    packed = _Packed()
    parts = [[3, 1, 4], [1], [], [5, 9, 2, 6, 5], list(range(8))]
    for part in parts:
        packed.add(part)
    sent = packed.send(CPU)
    assert [t.tolist() for t in sent] == parts
    assert all(t.dtype == torch.int32 and t.data_ptr() % 16 == 0 for t in sent)
