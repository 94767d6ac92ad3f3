"""Builds tpserve's C code with the package; everything else about the package is in pyproject.toml.

Two shared libraries, each beside the Python that loads it, in the wheel and (``pip install -e .``)
in the checkout:

    kv/attention/libpaged_decode.so              the CPU decode kernel, loaded through ctypes
                                                 (kv/attention/cpu_decode.py)
    cluster/routing/tpserve_native_rank.<abi>.so the router's ranking, a CPython extension
                                                 (cluster/routing/native_rank.py)

Flags, portable to the hosts a wheel or an image runs on:
  - the decode kernel: ``-O3 -fopenmp -ffast-math`` and ``-march=x86-64-v3`` (AVX2 and FMA:
    Intel from Haswell, AMD from Zen) where the compiler takes it. The environment variable
    ``TPSERVE_MARCH`` replaces that level: ``TPSERVE_MARCH=native pip install -e .`` builds for
    the building host, ``TPSERVE_MARCH=`` for no ``-march`` at all;
  - the router: ``-O2 -ffp-contract=off`` (no FMA: its scores are Python's doubles, bit for bit)
    and no ``-march``.
Each library links in a stamp (kv/native_stamp.py): the digest of its sources and the CPU flags
its ``-march`` needs. Its loader refuses it on a CPU without them, or after its sources changed,
and then compiles the sources for the machine it runs on at first use, with a warning.

Without a C compiler, or where a library fails to build, the install goes on without it and says
so; its loader then compiles at first use or runs the Python path, with one log line.
"""

import importlib.util
import os
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, LinkError, PlatformError

HERE = Path(__file__).parent
MARCH_ENV = "TPSERVE_MARCH"
DEFAULT_MARCH = "x86-64-v3"


def _native_stamp():
    """kv/native_stamp.py, loaded by path: the package is not importable while it is built."""
    spec = importlib.util.spec_from_file_location("_tpserve_native_stamp",
                                                  HERE / "kv" / "native_stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NativeLibrary(Extension):
    """A C library of tpserve's. ``ctypes``: a plain ``lib*.so`` with no Python ABI tag (loaded
    through ctypes, not imported); ``march``: built for `DEFAULT_MARCH` or ``$TPSERVE_MARCH``."""

    def __init__(self, name, sources, *, ctypes=False, march=False, **kwargs):
        super().__init__(name, sources, optional=True, **kwargs)
        self.ctypes, self.march = ctypes, march


class BuildNative(build_ext):
    """build_ext that stamps each library, builds it for a portable CPU level, and warns (instead
    of failing the install) where a library cannot be built."""

    def build_extension(self, ext):
        stamp = _native_stamp()
        march = self._march() if ext.march else ""
        sources = [HERE / path for path in (*ext.sources, *ext.depends)]
        flags = stamp.required_cpu_flags(march)
        stamp_c = self._write_stamp(ext, stamp.stamp_source(stamp.source_digest(sources), flags))
        original = (list(ext.sources), list(ext.extra_compile_args), list(ext.libraries))
        ext.sources.append(stamp_c)
        ext.extra_compile_args += [f"-march={march}"] if march else []
        try:
            self._build_linking_what_links(ext)
        except (CCompilerError, PlatformError) as exc:
            self.warn(f"{ext.name} is not built ({exc}): the package installs without it, and "
                      "its loader compiles it at first use or runs the Python path")
        finally:
            ext.sources, ext.extra_compile_args, ext.libraries = original

    def _build_linking_what_links(self, ext):
        """Builds ``ext``, linked without its ``libraries`` where the link fails with them (the
        decode kernel's libmvec: glibc's vector expf, which x86-64 has and others lack)."""
        try:
            super().build_extension(ext)
        except LinkError:
            if not ext.libraries:
                raise
            ext.libraries = []
            super().build_extension(ext)

    def _march(self):
        """``$TPSERVE_MARCH`` where set (empty: no ``-march``), else `DEFAULT_MARCH` where the
        compiler takes it (not on other architectures than x86-64), else none."""
        if MARCH_ENV in os.environ:
            return os.environ[MARCH_ENV].strip()
        with tempfile.TemporaryDirectory() as scratch:
            probe = Path(scratch) / "probe.c"
            probe.write_text("int probe(void) { return 0; }\n")
            try:
                self.compiler.compile([str(probe)], output_dir=scratch,
                                      extra_postargs=[f"-march={DEFAULT_MARCH}"])
            except CompileError:
                return ""
        return DEFAULT_MARCH

    def _write_stamp(self, ext, text):
        """The stamp's C file in the build folder, rewritten only where it changed (so that an
        unchanged library is not rebuilt)."""
        path = Path(self.build_temp) / f"{ext.name}.stamp.c"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        return str(path)

    def get_ext_filename(self, fullname):
        ext = self.ext_map.get(fullname)
        if isinstance(ext, NativeLibrary) and ext.ctypes:
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)


DECODE_KERNEL = NativeLibrary(
    "kv.attention.libpaged_decode", ["kv/attention/csrc/paged_decode.c"], ctypes=True, march=True,
    depends=["kv/attention/csrc/bf16_avx512.h"],
    # Linked without -ffast-math: see the source's comment. -fno-wrapv undoes Python's CFLAGS.
    extra_compile_args=["-O3", "-fopenmp", "-ffast-math", "-fno-wrapv"],
    extra_link_args=["-fopenmp"], libraries=["mvec"])
ROUTER_RANKING = NativeLibrary(
    "cluster.routing.tpserve_native_rank", ["cluster/routing/csrc/native_rank.c"],
    depends=["cluster/routing/csrc/prefix_table.h"],
    extra_compile_args=["-O2", "-ffp-contract=off", "-fno-strict-aliasing"])

if __name__ == "__main__":
    setup(ext_modules=[DECODE_KERNEL, ROUTER_RANKING], cmdclass={"build_ext": BuildNative})
