"""How busy the host was during a benchmark run: other processes share this machine's cores, and a
comparison run beside them is skewed, so each run reports these next to its figures."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpu_snapshot() -> Optional[Tuple[float, float, float]]:
    """(wall time, busy CPU seconds of the machine, CPU seconds of this process and its
    descendants: Ray's processes and workers), from /proc; None where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        children: Dict[int, List[int]] = {}
        usage: Dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # exited meanwhile
                children.setdefault(int(fields[1]), []).append(int(entry))
                usage[int(entry)] = int(fields[11]) + int(fields[12])  # utime + stime
    except OSError:
        return None
    mine, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        mine += usage.get(pid, 0)
        todo.extend(children.get(pid, ()))
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return time.monotonic(), busy / hz, mine / hz


def other_cpu_frac(before: Optional[Tuple[float, float, float]],
                   after: Optional[Tuple[float, float, float]]) -> Optional[float]:
    """Fraction of the machine's CPU capacity used by processes outside this benchmark."""
    if before is None or after is None:
        return None
    wall, busy, mine = (a - b for a, b in zip(after, before))
    return round(max(0.0, (busy - mine) / (wall * (os.cpu_count() or 1))), 3)
