"""kv/native_build.py: a build is keyed by its source and the headers it includes; the native
paths' off switch."""

from __future__ import annotations

import ctypes

import pytest

from kv.native_build import build_shared, switched_off


def test_a_changed_header_makes_a_new_build(tmp_path):
    header, source = tmp_path / "value.h", tmp_path / "answer.c"
    source.write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    built = []
    for value in (41, 42):
        header.write_text(f"#define VALUE {value}\n")
        path = build_shared(source, ("-O2", "-fPIC"), ("-shared",), cache_dir=tmp_path / "k",
                            headers=(header,))
        built.append(path)
        assert ctypes.CDLL(str(path)).answer() == value
    assert built[0] != built[1]


@pytest.mark.parametrize("value, off", [("0", True), ("false", True), ("OFF", True), ("no", True),
                                        ("1", False), ("", False), (None, False)])
def test_switched_off_reads_the_switch(monkeypatch, value, off):
    if value is None:
        monkeypatch.delenv("TPSERVE_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TPSERVE_TEST_SWITCH", value)
    assert switched_off("TPSERVE_TEST_SWITCH") is off
