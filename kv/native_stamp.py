"""What a C library built with the package (``setup.py``) records about its build, and the check a
loader makes before it uses one.

A library built by ``setup.py`` links in a stamp (`stamp_source`), two strings:

    tpserve_source_sha256   `source_digest` of the C sources it was built from
    tpserve_cpu_flags       the CPU flags its instructions need, as /proc/cpuinfo names them

`check_stamp` reads them after ``dlopen``, which runs none of the library's own code, so a library
built for AVX2 is refused on a CPU without it (instead of the process dying of SIGILL in its
first call), and one built from sources edited since (an editable install's library after a change
to the C) is refused instead of run. Its loader then compiles the sources at first use
(`kv.native_build`).

Only the standard library, and no import of the package: ``setup.py`` loads this file by path
before the package is installed.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from pathlib import Path
from typing import FrozenSet, Optional, Sequence, Tuple

# The x86-64 micro-architecture levels (the psABI's) as /proc/cpuinfo flags; each level needs the
# ones before it too.
X86_64_LEVELS = {
    "x86-64": (),
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"),
    "x86-64-v4": ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"),
}
# The flags of /proc/cpuinfo that name instruction-set extensions (the rest say how the CPU or the
# hypervisor behaves, and differ between hosts that run the same code).
_ISA_FLAG = re.compile(r"(sse\w*|ssse3|pni|avx\w*|amx\w*|fma\w*|f16c|bmi\d|abm|movbe|popcnt|lahf_lm"
                       r"|cx16|xsave|adx|aes|pclmulqdq|vaes|vpclmulqdq|gfni|sha_ni)")


class LibraryRefused(RuntimeError):
    """A built library that must not run here; the message says which and why."""


def source_digest(sources: Sequence[Path]) -> str:
    """The SHA-256 of the sources' bytes, in order (the C file, then the headers it includes)."""
    return hashlib.sha256(b"\0".join(path.read_bytes() for path in sources)).hexdigest()


def cpu_flags() -> Optional[FrozenSet[str]]:
    """This CPU's flags from /proc/cpuinfo; None where it cannot be read (not Linux, or not x86)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def required_cpu_flags(march: str) -> Tuple[str, ...]:
    """What code built with ``-march=MARCH`` needs of a CPU: the level's flags for an x86-64 level
    (and none for no ``-march``); for anything else (``native``, a CPU's name) every
    instruction-set flag of the CPU building it, which may be more than the code uses."""
    if not march:
        return ()
    if march in X86_64_LEVELS:
        levels = list(X86_64_LEVELS)
        return tuple(flag for level in levels[:levels.index(march) + 1]
                     for flag in X86_64_LEVELS[level])
    return tuple(sorted(flag for flag in cpu_flags() or () if _ISA_FLAG.fullmatch(flag)))


def stamp_source(digest: str, flags: Sequence[str]) -> str:
    """The C source of a stamp, compiled and linked into the library it describes."""
    return ("/* Written by setup.py: what kv/native_stamp.py checks before the library is used. */\n"
            f'const char *const tpserve_source_sha256 = "{digest}";\n'
            f'const char *const tpserve_cpu_flags = "{" ".join(flags)}";\n')


def check_stamp(library: Path, sources: Sequence[Path]) -> None:
    """Returns if ``library`` may run here; raises `LibraryRefused` where it has no stamp, was
    built from other sources than ``sources`` as they are now (unchecked where a source is
    absent), or needs CPU flags this CPU lacks, and OSError where it cannot be loaded."""
    handle = ctypes.CDLL(str(library))
    try:
        digest, flags = (ctypes.c_char_p.in_dll(handle, name).value.decode()
                         for name in ("tpserve_source_sha256", "tpserve_cpu_flags"))
    except ValueError:  # a symbol that is not there
        raise LibraryRefused(f"{library} has no build stamp (it was not built by setup.py)") from None
    if all(path.exists() for path in sources) and digest != source_digest(sources):
        raise LibraryRefused(f"{library} was built from other sources than "
                             f"{', '.join(path.name for path in sources)} (edited since? "
                             "`pip install -e .` rebuilds it)")
    have = cpu_flags()
    missing = [flag for flag in flags.split() if have is None or flag not in have]
    if missing:
        raise LibraryRefused(f"{library} is built for CPUs with {' '.join(missing)}, which this "
                             "CPU lacks" + (" (its flags cannot be read)" if have is None else ""))
