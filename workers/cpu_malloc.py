"""Keep freed large buffers in the process between steps instead of handing them back to the
kernel (CPU ranks, glibc only).

A CPU step allocates and frees the same large temporaries every time (activations, gathered K/V:
hundreds of KiB to MiB each). glibc's malloc serves such sizes with fresh ``mmap`` pages, or trims
its heap after freeing them, so the next step page-faults every page in again (the kernel zeroes
each one; docs/benchmarks/engine.md). Raising the mmap and trim thresholds keeps the
pages mapped and reused; the process then holds its peak working set, as a serving process does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap threshold to its maximum (32 MiB) and its trim threshold to 1 GiB, for
    the whole process. Returns False (and changes nothing) where malloc is not glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.info("malloc thresholds unchanged: mallopt refused them")
    return ok
