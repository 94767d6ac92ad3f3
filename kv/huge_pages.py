"""A CPU rank's weights on 2 MiB pages (Linux transparent huge pages).

A decode step streams every weight from memory; with 4 KiB pages that is a TLB miss every 4 KiB.
Once a CPU rank has loaded and packed its weights, ``back_with_huge_pages`` asks the kernel to
move them onto huge pages (``madvise(MADV_COLLAPSE)``, Linux 6.1+, whatever the system's THP mode
but ``never``), their contents as they were, at the cost of a copy while the rank starts. Ranges
closer than 2 MiB are joined, each widened to whole 2 MiB pages (memory the process already had
beside them moves too, at most 2 MiB each side); less than ``MIN_COLLAPSE_BYTES`` in all is left
alone (a few pages gain nothing). Where the kernel refuses, nothing changes (a log line says so);
``TPSERVE_CPU_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
from typing import Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25
MIN_COLLAPSE_BYTES = 64 << 20
SWITCH_ENV = "TPSERVE_CPU_HUGE_PAGES"

Span = Tuple[int, int]  # [start, end) addresses


def tensor_span(tensor: torch.Tensor) -> Optional[Span]:
    """The address range of a CPU tensor's data (oneDNN-packed ones included); None for other
    devices and empty tensors."""
    if tensor.device.type != "cpu":
        return None
    if tensor.is_mkldnn:
        start, size = torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    else:
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
    return (start, start + size) if size else None


def huge_page_spans(spans: Iterable[Optional[Span]]) -> List[Span]:
    """``spans`` joined where less than a huge page apart and widened to whole huge pages."""
    joined: List[List[int]] = []
    for start, end in sorted(s for s in spans if s is not None):
        if joined and start - joined[-1][1] < HUGE_PAGE:
            joined[-1][1] = max(joined[-1][1], end)
        else:
            joined.append([start, end])
    return [(start // HUGE_PAGE * HUGE_PAGE, -(-end // HUGE_PAGE) * HUGE_PAGE)
            for start, end in joined]


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the memory of ``tensors`` onto huge pages; returns the bytes moved (0 where the
    switch is off, the platform has no ``MADV_COLLAPSE``, the tensors hold less than
    ``MIN_COLLAPSE_BYTES`` or the kernel refused every range)."""
    spans = huge_page_spans(tensor_span(t) for t in tensors)
    madvise = _madvise()
    if madvise is None or sum(end - start for start, end in spans) < MIN_COLLAPSE_BYTES:
        return 0
    moved, refused = 0, set()
    for start, end in spans:
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            moved += end - start
            continue
        # The widened range may reach memory that is not mapped: its inner huge pages only.
        inner = (start + HUGE_PAGE, end - HUGE_PAGE)
        if inner[1] > inner[0] and madvise(inner[0], inner[1] - inner[0], MADV_COLLAPSE) == 0:
            moved += inner[1] - inner[0]
        else:
            refused.add(errno.errorcode.get(ctypes.get_errno(), "?"))
    if refused:
        logger.info("huge pages: the kernel refused some ranges (%s); those stay on 4 KiB "
                    "pages", ", ".join(sorted(refused)))
    return moved


def _madvise():
    """libc's madvise; None off Linux or where the switch is off."""
    if os.environ.get(SWITCH_ENV, "1") == "0" or os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
