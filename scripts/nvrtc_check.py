"""``check_gpu_kernels.py``'s CUDA C part: the kernels tpserve compiles from CUDA C at run time
(CuPy ``RawKernel``s: the KV tiers' device checksum, `kv.integrity.cupy_checksum`) compiled by NVRTC, the
library CuPy compiles them with, for a given GPU architecture, without a GPU: NVRTC is a compiler
and needs no driver. Its ``ptxas -v`` log gives registers, spills and shared memory.

NVRTC comes from the ``nvidia-cuda-nvrtc-cu12`` wheel (which CUDA builds of torch install, and
the dev dependencies here), or from a CUDA toolkit on the library path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import time
from pathlib import Path
from typing import Dict, List, Optional

from kv.integrity import cupy_checksum

# (name, CUDA C source) of every run-time compiled kernel.
CUDA_KERNELS = ((cupy_checksum._KERNEL_NAME, cupy_checksum.KERNEL_SOURCE),)


def ptxas_figures(log: str) -> Optional[Dict[str, int]]:
    """Registers, spill bytes and shared memory from a ``ptxas -v`` log (None without them)."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    shared = re.search(r"(\d+) bytes smem", log)
    if registers is None or spills is None:
        return None
    return {"registers": int(registers.group(1)),
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
            "shared_bytes": int(shared.group(1)) if shared else 0}


def kernel_problems(has_cubin: bool, shared_bytes: int, spill_bytes: int,
                    max_shared_bytes: int) -> List[str]:
    """What is wrong with a compiled kernel (nothing: an empty list)."""
    problems = [] if has_cubin else ["no cubin"]
    if shared_bytes > max_shared_bytes:
        problems.append(f"{shared_bytes} bytes of shared memory > the {max_shared_bytes} a "
                        f"block may use")
    if spill_bytes:
        problems.append(f"spills {spill_bytes} bytes of registers")
    return problems


def find_nvrtc() -> Optional[str]:
    """The NVRTC library to load: the pip wheel's, else one on the library path; None if none."""
    try:
        import nvidia.cuda_nvrtc as wheel  # a namespace package of the nvidia-* wheels
    except ImportError:
        wheel = None
    if wheel is not None:
        for directory in wheel.__path__:
            found = sorted(p for p in (Path(directory) / "lib").glob("libnvrtc.so*")
                           if ".alt." not in p.name and "builtins" not in p.name)
            if found:
                return str(found[0])
    return ctypes.util.find_library("nvrtc")


class Nvrtc:
    """The few NVRTC calls a compile needs (the C API, through ctypes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, name: str, arch: int) -> tuple:
        """``(ok, log, cubin bytes)`` of ``source`` compiled for ``sm_<arch>``, with ptxas's
        ``-v`` figures in the log."""
        lib = self._lib
        program = ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(),
                                    f"{name}.cu".encode(), 0, None, None)
        if rc != 0:
            return False, f"nvrtcCreateProgram returned {rc}", 0
        try:
            options = [f"--gpu-architecture=sm_{arch}".encode(), b"--ptxas-options=-v"]
            rc = lib.nvrtcCompileProgram(program, len(options),
                                         (ctypes.c_char_p * len(options))(*options))
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            cubin_size = ctypes.c_size_t()
            if rc == 0:
                lib.nvrtcGetCUBINSize(program, ctypes.byref(cubin_size))
            return rc == 0, log.value.decode(errors="replace"), cubin_size.value
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))


def compile_cuda_kernel(nvrtc: Nvrtc, name: str, source: str, arch: int,
                        max_shared_bytes: int) -> Dict:
    """One kernel compiled for ``arch``: its figures and what is wrong with it (``problems``)."""
    started = time.perf_counter()
    ok, log, cubin_bytes = nvrtc.compile(source, name, arch)
    compile_s = time.perf_counter() - started
    if not ok:
        return {"kernel": name, "problems": [f"NVRTC: {log[-2000:]}"]}
    figures = ptxas_figures(log)
    if figures is None:
        return {"kernel": name, "problems": [f"no ptxas -v figures in NVRTC's log: {log[-500:]}"]}
    return {"kernel": name, "num_warps": "-", **figures, "compile_s": round(compile_s, 2),
            "cubin_bytes": cubin_bytes,
            "problems": kernel_problems(bool(cubin_bytes), figures["shared_bytes"],
                                        figures["spill_bytes"], max_shared_bytes)}
