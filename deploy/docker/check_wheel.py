"""Checks that a tpserve wheel carries its native code: each library setup.py builds, and the C
sources (and headers) it is built from, which its loader digests and compiles at first use on a
CPU the built library cannot run on.

    python deploy/docker/check_wheel.py dist/tpserve-0.1.0-cp312-cp312-linux_x86_64.whl

Exits 1 naming what the wheel lacks. The libraries are read from setup.py (the checkout's, two
folders up), so the check follows what it builds. Only the standard library and setuptools.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from typing import List

SETUP_PY = Path(__file__).resolve().parents[2] / "setup.py"


def native_libraries(setup_py: Path = SETUP_PY) -> list:
    """The extensions setup.py builds (its ``NativeLibrary`` objects), loaded by path."""
    spec = importlib.util.spec_from_file_location("_tpserve_setup", setup_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [value for value in vars(module).values() if isinstance(value, module.NativeLibrary)]


def missing_from_wheel(wheel: Path, setup_py: Path = SETUP_PY) -> List[str]:
    """What the wheel lacks: a library as ``package/name.so`` (``package/name.<abi>.so`` for a
    CPython extension), and each of its sources and headers at its path in the checkout."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = []
    for library in native_libraries(setup_py):
        stem = library.name.replace(".", "/")
        if not any(n.startswith(stem + ".") and n.endswith(".so") for n in names):
            missing.append(f"{stem}.so" if library.ctypes else f"{stem}.<abi>.so")
        missing += [path for path in (*library.sources, *library.depends) if path not in names]
    return missing


def main(argv: List[str]) -> int:
    if len(argv) != 1:
        print("usage: check_wheel.py WHEEL", file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    if not wheel.is_file():
        print(f"check_wheel.py: no wheel at {wheel}", file=sys.stderr)
        return 2
    missing = missing_from_wheel(wheel)
    if missing:
        print(f"{wheel.name} lacks tpserve's native code: {', '.join(missing)} (did a library "
              "fail to compile? see the build's warnings)", file=sys.stderr)
        return 1
    print(f"{wheel.name}: native libraries and their sources present")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
