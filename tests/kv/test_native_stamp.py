"""kv/native_stamp.py: a library built with the package is refused where its sources changed or
the CPU lacks what it was built for, before any of its code runs."""

from __future__ import annotations

import pytest

from kv.native_build import build_shared
from kv.native_stamp import (X86_64_LEVELS, LibraryRefused, check_stamp, cpu_flags,
                             required_cpu_flags, source_digest, stamp_source)


def _stamped_library(tmp_path, sources, flags):
    """A library of one function, stamped as setup.py stamps one built from ``sources``."""
    source = tmp_path / "stamped.c"
    source.write_text(stamp_source(source_digest(sources), flags)
                      + "int answer(void) { return 42; }\n")
    return build_shared(source, ("-O2", "-fPIC"), ("-shared",), cache_dir=tmp_path / "k")


def test_a_library_of_these_sources_for_this_cpu_is_taken(tmp_path):
    sources = [tmp_path / "a.c", tmp_path / "a.h"]
    for path in sources:
        path.write_text(f"/* {path.name} */\n")
    have = sorted(cpu_flags() or ())[:2]
    check_stamp(_stamped_library(tmp_path, sources, have), sources)


def test_a_library_of_other_sources_is_refused(tmp_path):
    source = tmp_path / "a.c"
    source.write_text("/* before */\n")
    library = _stamped_library(tmp_path, [source], ())
    source.write_text("/* after */\n")
    with pytest.raises(LibraryRefused, match=r"built from other sources than a.c \(edited since"):
        check_stamp(library, [source])
    check_stamp(library, [tmp_path / "gone.c"])  # sources not shipped: nothing to compare


def test_a_library_for_another_cpu_is_refused(tmp_path):
    library = _stamped_library(tmp_path, [], ("no_such_flag",))
    with pytest.raises(LibraryRefused, match="built for CPUs with no_such_flag, which this CPU"):
        check_stamp(library, [])


def test_a_library_without_a_stamp_is_refused(tmp_path):
    source = tmp_path / "plain.c"
    source.write_text("int answer(void) { return 42; }\n")
    library = build_shared(source, ("-O2", "-fPIC"), ("-shared",), cache_dir=tmp_path / "k")
    with pytest.raises(LibraryRefused, match="has no build stamp"):
        check_stamp(library, [source])


def test_an_x86_64_level_needs_its_flags_and_those_below():
    v3 = required_cpu_flags("x86-64-v3")
    assert {"avx2", "fma", "sse4_2", "popcnt"} <= set(v3)
    assert not set(v3) & set(X86_64_LEVELS["x86-64-v4"])
    assert required_cpu_flags("") == () and required_cpu_flags("x86-64") == ()


def test_native_needs_this_cpus_instruction_set_flags_only():
    native = set(required_cpu_flags("native"))
    assert native <= (cpu_flags() or set())
    assert not native & {"hypervisor", "constant_tsc", "fpu"}
