"""The package as a user gets it: a wheel built by setup.py carries the compiled C code and its
sources, and installed (not run from the checkout) it loads both libraries with no fallback; a
build without a C compiler still makes a wheel, without them. setup.py builds with the flags the
loaders compile with at first use."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from cluster.routing import native_rank
from kv.attention import cpu_decode
from kv.native_stamp import cpu_flags, required_cpu_flags

REPO = Path(__file__).resolve().parent.parent
NATIVE_FILES = ("kv/attention/libpaged_decode.so",
                f"cluster/routing/tpserve_native_rank{sysconfig.get_config_var('EXT_SUFFIX')}")
SOURCES = ("kv/attention/csrc/paged_decode.c", "kv/attention/csrc/bf16_avx512.h",
           "cluster/routing/csrc/native_rank.c", "cluster/routing/csrc/prefix_table.h")
# Run by the installed package's Python, from outside the checkout: what it imported and loaded.
PROBE = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"{record.levelname} {record.name}: {record.getMessage()}")
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)
import cluster, kv
from cluster.routing import native_rank
from kv.attention import cpu_decode
kernel, ranking = cpu_decode.decode_kernel(), native_rank.load()
print(json.dumps({"cluster": cluster.__file__, "kv": kv.__file__, "records": records,
                  "kernel": kernel and str(kernel.path), "ranking": ranking and ranking.__file__}))
"""


def _run(command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


def _checkout_copy(tmp_path: Path) -> Path:
    """The checkout's files as git sees them (tracked, or new and not ignored): no build folder,
    no library an editable install built, nothing of another build running at once."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    names = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 cwd=REPO).stdout.split("\0")
    source = tmp_path / "src"
    for name in filter(None, names):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    return source


def _build_wheel(source: Path, out: Path, env=None) -> Path:
    done = _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                 "--no-build-isolation", "-v", "-w", str(out)], env=env)
    [wheel] = out.glob("tpserve-*.whl")
    return wheel, done.stdout + done.stderr


def _venv_with_wheel(tmp_path: Path, wheel: Path) -> Path:
    """A fresh venv with the wheel installed, that sees this environment's packages (torch, Ray)
    through a .pth file, and not the checkout. The .pth is written after the install, so that pip
    never sees (nor touches) this environment's own tpserve."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", str(wheel)])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())
    here = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (site / "tpserve_test_deps.pth").write_text("".join(f"{path}\n" for path in sorted(here)))
    return python


@pytest.mark.slow
def test_the_installed_wheel_loads_its_compiled_code(tmp_path):
    if not set(required_cpu_flags("x86-64-v3")) <= (cpu_flags() or set()):
        pytest.skip("this CPU is below x86-64-v3, the level the wheel's kernel is built for")
    wheel, _ = _build_wheel(_checkout_copy(tmp_path), tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(NATIVE_FILES) | set(SOURCES) <= names
    python = _venv_with_wheel(tmp_path, wheel)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", cpu_decode.SWITCH_ENV, native_rank.SWITCH_ENV, "CC")}
    env["TPSERVE_CACHE"] = str(tmp_path / "cache")  # where a fallback would compile
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    found = json.loads(_run([str(python), "-c", PROBE], cwd=outside, env=env).stdout)
    site = python.parent.parent / "lib"
    assert all(Path(found[name]).is_relative_to(site) for name in ("cluster", "kv")), found
    assert found["kernel"] and found["kernel"].endswith(NATIVE_FILES[0]), found
    assert found["ranking"] and found["ranking"].endswith(NATIVE_FILES[1]), found
    assert Path(found["kernel"]).is_relative_to(site) and Path(found["ranking"]).is_relative_to(site)
    assert not [r for r in found["records"] if not r.startswith(("INFO", "DEBUG"))], found
    assert not (tmp_path / "cache").exists()  # nothing compiled at first use


@pytest.mark.slow
def test_without_a_compiler_the_package_builds_without_its_compiled_code(tmp_path):
    source = _checkout_copy(tmp_path)
    env = {**os.environ, "CC": "/nonexistent/cc"}
    wheel, log = _build_wheel(source, tmp_path / "dist", env=env)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(SOURCES) <= names and not set(NATIVE_FILES) & names
    assert "kv.attention.libpaged_decode is not built" in log
    assert "cluster.routing.tpserve_native_rank is not built" in log
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")], cwd=source)
    [sdist] = (tmp_path / "sdist").glob("tpserve-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {name.partition("/")[2] for name in archive.getnames()}
    assert {"setup.py", "kv/native_stamp.py", *SOURCES} <= members


def test_setup_builds_with_the_flags_the_loaders_compile_with():
    """One set of flags per library: the package build differs from the first-use one only in
    its -march (portable there, native here) and what Python's build flags bring."""
    setup = runpy.run_path(str(REPO / "setup.py"), run_name="tpserve_setup")
    kernel, ranking = setup["DECODE_KERNEL"], setup["ROUTER_RANKING"]
    first_use = set(cpu_decode.COMPILE_FLAGS) - {"-march=native", "-fPIC"}
    assert set(kernel.extra_compile_args) - {"-fno-wrapv"} == first_use
    assert kernel.extra_link_args == [f for f in cpu_decode.LINK_FLAGS if f != "-shared"]
    assert [f"-l{name}" for name in kernel.libraries] == list(cpu_decode.LINK_LIBRARIES[0])
    assert set(ranking.extra_compile_args) == {
        f for f in native_rank.compile_flags() if f != "-fPIC" and not f.startswith("-I")}
    assert [Path(s) for s in kernel.sources] == [cpu_decode.SOURCE.relative_to(REPO)]
    assert [Path(s) for s in (*ranking.sources, *ranking.depends)] == [
        path.relative_to(REPO) for path in (native_rank.SOURCE, *native_rank.HEADERS)]
