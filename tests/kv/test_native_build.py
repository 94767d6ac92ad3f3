"""kv/native_build.py: a build is keyed by its source and the headers it includes."""

from __future__ import annotations

import ctypes

from kv.native_build import build_shared


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
