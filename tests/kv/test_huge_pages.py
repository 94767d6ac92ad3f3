"""Weights moved onto 2 MiB pages (``kv.huge_pages``): spans, the move itself (read back from the
process's smaps), and which of a CPU rank's weights it takes."""

import pathlib

import pytest
import torch

from kv.huge_pages import (HUGE_PAGE, MIN_COLLAPSE_BYTES, SWITCH_ENV, back_with_huge_pages,
                           huge_page_spans)
from parallel.onednn_linear import PackedWeight, can_pack
from workers.rank import weights_on_huge_pages

MIB = 1 << 20
THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_bytes() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def needs_collapse():
    """Skip where this kernel cannot move memory onto huge pages (THP off, or MADV_COLLAPSE
    refused: kernels before 6.1)."""
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off here")
    if back_with_huge_pages([torch.ones(MIN_COLLAPSE_BYTES + 4 * MIB, dtype=torch.uint8)]) == 0:
        pytest.skip("this kernel refuses MADV_COLLAPSE")


def test_spans_join_when_close_and_widen_to_whole_huge_pages():
    h = HUGE_PAGE
    spans = [(5 * h + 10, 6 * h), None, (h + 3, h + 100), (6 * h + 50, 7 * h + 1), (h + 200, h + 300)]
    assert huge_page_spans(spans) == [(h, 2 * h), (5 * h, 8 * h)]
    assert huge_page_spans([(0, h), (3 * h, 4 * h)]) == [(0, h), (3 * h, 4 * h)]  # 2 MiB apart


def test_weights_move_onto_huge_pages_with_their_contents():
    needs_collapse()
    weights = torch.randn(20 * MIB).bfloat16()  # 40 MiB
    more = torch.randn(16 * MIB)  # 64 MiB
    want = (weights.clone(), more.clone())
    before = anon_huge_bytes()
    moved = back_with_huge_pages([weights, more])
    assert moved >= 100 * MIB
    assert anon_huge_bytes() - before >= 96 * MIB
    assert torch.equal(weights, want[0]) and torch.equal(more, want[1])


def test_a_few_pages_or_the_switch_off_move_nothing(monkeypatch):
    assert back_with_huge_pages([torch.ones(8 * MIB, dtype=torch.uint8)]) == 0
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert back_with_huge_pages([torch.ones(80 * MIB, dtype=torch.uint8)]) == 0


def test_a_rank_moves_packed_copies_not_the_dense_weights_they_replace():
    """A packed linear's dense weight is not read by its steps: only the packed copy moves (and
    the parameters of modules without one)."""
    needs_collapse()
    weight = torch.randn(6144, 6144).bfloat16()  # 72 MiB
    if not can_pack(weight):
        pytest.skip("oneDNN cannot pack bf16 weights here")
    linear = torch.nn.Linear(6144, 6144, bias=False).to(torch.bfloat16)
    linear.weight.data = weight
    linear.packed = PackedWeight(weight)
    norm = torch.nn.LayerNorm(6144)
    model = torch.nn.Sequential(linear, norm)
    before = anon_huge_bytes()
    weights_on_huge_pages(model)
    gained = anon_huge_bytes() - before
    assert 70 * MIB <= gained < 110 * MIB  # the packed copy (72 MiB) and pages beside it
