"""Compile a C source of tpserve's into a shared library on first use, with the machine's C
compiler, cached on disk: the fallback where the library built with the package (``setup.py``)
is missing or must not run here (`load_shipped_or_built`).

    path = build_shared(SOURCE, compile_flags, link_flags, link_libraries)

``$CC`` (default ``cc``) compiles ``SOURCE`` with ``compile_flags``, then links it with
``link_flags`` plus the first of ``link_libraries`` (alternatives, tried in order) that links.
The library goes to ``kernels`` under tpserve's cache root (``$TPSERVE_CACHE``, default
``~/.cache/tpserve``; where that cannot be written, a folder in the temporary directory), one
file per source, flags, compiler and CPU (``-march=native`` code runs only on CPUs like the one
that built it), written under a temporary name and renamed, so processes building at once never
load a partial file. Users: `kv.attention.cpu_decode` (the CPU decode kernel, through ctypes) and
`cluster.routing.native_rank` (the router's ranking, a CPython extension).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

from kv.native_stamp import LibraryRefused, check_stamp

CACHE_ENV = "TPSERVE_CACHE"  # the cache root the default model lives under too
COMPILE_TIMEOUT_S = 120


def switched_off(env: str) -> bool:
    """True where the environment variable ``env`` turns a native path off: 0, false, off or no
    (any case); unset or anything else leaves it on."""
    return os.environ.get(env, "1").lower() in ("0", "false", "off", "no")


class KernelBuildError(RuntimeError):
    """The code could not be compiled or loaded; the message says which command and why."""


Loaded = TypeVar("Loaded")


def load_shipped_or_built(library: Path, sources: Sequence[Path], load: Callable[[Path], Loaded],
                          build: Callable[[], Path]) -> Tuple[Loaded, Optional[str]]:
    """``load(library)``, the library built with the package, where it is there, loads and passes
    `check_stamp` against ``sources``; else ``load(build())``, compiled now for this machine.
    Returns what ``load`` returned and why the package's library was not used (None: it was).
    Raises `KernelBuildError` naming both failures where neither can be used."""
    try:
        if not library.exists():
            raise LibraryRefused(f"{library} is missing (the package was built without a C "
                                 "compiler, or this checkout without `pip install -e .`)")
        check_stamp(library, sources)
        return load(library), None
    except (LibraryRefused, OSError, ImportError) as exc:
        why = str(exc)
    try:
        return load(build()), why
    except (KernelBuildError, OSError, ImportError) as exc:
        raise KernelBuildError(f"{why}; compiling it at first use failed: {exc}") from None


def build_shared(source_path: Path, compile_flags: Sequence[str], link_flags: Sequence[str],
                 link_libraries: Sequence[Sequence[str]] = ((),),
                 cache_dir: Optional[Path] = None, headers: Sequence[Path] = ()) -> Path:
    """The compiled library's path, compiling it unless a build for this source (and the
    ``headers`` it includes), these flags, compiler and CPU is cached. Raises `KernelBuildError`
    naming the command and its error."""
    compiler = os.environ.get("CC", "cc")
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} (from $CC, default cc) is not on "
                               "PATH")
    source = b"\0".join(path.read_bytes() for path in (source_path, *headers))
    flags = " ".join([*compile_flags, *link_flags]).encode()
    key = hashlib.sha256(b"\0".join([source, flags, compiler_path.encode(),
                                     cpu_signature().encode()]))
    directory = cache_dir or _writable(kernel_cache_dir())
    target = directory / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=target.stem + ".", dir=directory) as scratch:
        obj, partial = Path(scratch) / f"{source_path.stem}.o", Path(scratch) / target.name
        _run([compiler_path, *compile_flags, "-c", str(source_path), "-o", str(obj)])
        for libraries in link_libraries:
            link = [compiler_path, *link_flags, str(obj), "-o", str(partial), *libraries]
            try:
                _run(link)
                break
            except KernelBuildError:
                if libraries is link_libraries[-1]:
                    raise
        os.replace(partial, target)  # atomic: a process building at once loads one or the other
    return target


def _writable(directory: Path) -> Path:
    """``directory``, or a folder of this user's in the temporary directory where it cannot be
    made or written (a read-only home in a container)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return directory
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"tpserve-kernels-{os.getuid()}"


def _run(command: List[str]) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise KernelBuildError(f"`{' '.join(command)}` ran past {COMPILE_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-800:]
        raise KernelBuildError(f"`{' '.join(command)}` exited {done.returncode}: {tail}")


def kernel_cache_dir() -> Path:
    """``kernels`` under tpserve's cache root: ``$TPSERVE_CACHE``, else ``~/.cache/tpserve`` (as
    `workers.default_model.cache_root`)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tpserve"
    return Path(root).expanduser().absolute() / "kernels"


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's model and flags."""
    signature = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    signature += line
                if line.startswith("flags"):
                    break
    except OSError:
        signature += platform.processor()
    return signature
