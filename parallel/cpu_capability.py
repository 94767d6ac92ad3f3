"""What this CPU offers for bfloat16, and which path bf16 math takes on it.

    support = cpu_bf16_support()        # this process's CPU, probed once
    support.is_fast                     # True with AMX or AVX-512 BF16
    bf16_path(flags)                    # the pure rule, on a set of /proc/cpuinfo flags

The rule (`bf16_path`): ``amx`` where the CPU has AMX tiles with bf16 (``amx_bf16`` and
``amx_tile``: Intel Sapphire Rapids on), else ``avx512_bf16`` where it has AVX-512 BF16 (Intel
Cooper Lake, AMD Zen 4 on), else ``None``: no bf16 instructions, so oneDNN converts every bf16
operand to fp32 and bf16 runs slower than fp32. The flags come from /proc/cpuinfo; where that
cannot be read (not Linux, not x86), oneDNN's own answer (``torch.ops.mkldnn``) decides (path
``"onednn"``), and a CPU it does not vouch for counts as slow. `workers.rank.resolve_dtype` picks bf16 for ``--dtype
auto`` on a fast CPU and warns on a slow one.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import FrozenSet, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

AMX_FLAGS = ("amx_bf16", "amx_tile")
AVX512_BF16_FLAG = "avx512_bf16"
CPUINFO = "/proc/cpuinfo"


def bf16_path(flags: Iterable[str]) -> Optional[str]:
    """``"amx"``, ``"avx512_bf16"`` or None (no bf16 instructions) for a CPU with ``flags``
    (/proc/cpuinfo names)."""
    have = set(flags)
    if all(flag in have for flag in AMX_FLAGS):
        return "amx"
    if AVX512_BF16_FLAG in have:
        return "avx512_bf16"
    return None


@dataclass(frozen=True)
class CpuBf16Support:
    """This CPU's bf16 instructions (``path``: `bf16_path`'s answer) and what torch says of it."""

    path: Optional[str]
    flags_known: bool  # False: /proc/cpuinfo had no flags, oneDNN's answer decided
    mkldnn_available: bool  # torch.backends.mkldnn: the oneDNN the packed linears use
    onednn_bf16: bool  # oneDNN runs bf16 here (natively or converting to fp32)
    cpu_capability: str  # torch's vector ISA level for its own CPU kernels

    @property
    def is_fast(self) -> bool:
        """bf16 math runs on bf16 instructions: bf16 is then the faster dtype on this CPU."""
        return self.path is not None

    def describe(self) -> str:
        """One line: the instructions bf16 takes and what torch reports."""
        where = "" if self.flags_known else " (no CPU flags readable; oneDNN's answer)"
        path = {"amx": "AMX tiles", "avx512_bf16": "AVX-512 BF16", "onednn": "oneDNN's",
                None: "none: bf16 is converted to fp32 on every op (slow)"}[self.path]
        return (f"bf16 instructions: {path}{where}; torch CPU capability {self.cpu_capability}, "
                f"mkldnn {'available' if self.mkldnn_available else 'unavailable'}, "
                f"oneDNN bf16 {'yes' if self.onednn_bf16 else 'no'}")


def read_cpu_flags(path: str = CPUINFO) -> Optional[FrozenSet[str]]:
    """The ``flags`` of the first CPU in ``path``; None where there are none to read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def probe_support(flags: Optional[FrozenSet[str]]) -> CpuBf16Support:
    """The support of a CPU with ``flags`` (None: unknown) as torch here reports it."""
    mkldnn = torch.backends.mkldnn.is_available()
    is_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    onednn_bf16 = bool(mkldnn and is_bf16 is not None and is_bf16())
    if flags is not None:
        path = bf16_path(flags)
    else:  # oneDNN vouches for bf16 without naming the instructions
        path = "onednn" if onednn_bf16 else None
    return CpuBf16Support(path, flags is not None, mkldnn, onednn_bf16,
                          torch.backends.cpu.get_cpu_capability())


@functools.lru_cache(maxsize=None)
def cpu_bf16_support() -> CpuBf16Support:
    """This CPU's support, probed once per process (and logged then)."""
    support = probe_support(read_cpu_flags())
    logger.info("CPU %s", support.describe())
    return support
