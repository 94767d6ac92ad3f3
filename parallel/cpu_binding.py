"""Cores of their own for CPU ranks, claimed on a host-wide registry; the rest of the host's
cores left to everything else.

    binding = bind_rank_cores(num_threads)   # this process: on cores of its own, or None
    serving_cores(num_ranks)                 # the cores the ranks will leave free

A CPU rank computes its whole step on one thread per torch thread; on a small host the other
processes of a server (HTTP proxy, API replicas, Ray's daemons) and the rank's own event loop
would otherwise take turns on the same cores. The rules:

- A rank **claims** one core per torch thread, the lowest-numbered cores nobody holds, and only
  while at least ``reserve`` (1) of the node's cores stay unclaimed; else it claims nothing and
  runs where the OS puts it (said once in the log).
- The claiming process runs **every thread of its own** on the claimed cores (its event loop and
  Ray's threads too: a thread holding the GIL then waits only for the rank, not for another
  process's turn on a busy core). Threads started later inherit the cores.
- A claiming process asks for a **higher priority** than the host's other processes on its cores
  (``nice``, -10 by default: `--cpu-rank-nice`): a foreign process that lands on a claimed core
  (a load generator, a metrics agent: nothing binds those) then takes a tenth of the core while
  the rank computes, not half of it. Every thread of the process gets it, and threads started
  later inherit it. Raising a priority needs ``CAP_SYS_NICE`` (or ``RLIMIT_NICE``); where the
  process may not, it keeps its priority and the log says so once.
- Claims live in one JSON file per host (`registry_path`: ``$TPSERVE_CORE_REGISTRY``, else
  ``/dev/shm/tpserve-cores.json``), under an exclusive ``flock``. A claim names its process by
  pid and start time; a claim whose process has exited (or whose pid now names another process)
  is dropped by the next claim.
- Where a cgroup CPU quota gives the process fewer CPUs than its affinity lists (a container
  limited by quota, not by a cpuset: its cores are shared with other containers, which may bind
  the same ones), nothing is bound.
- The node's cores are ``$TPSERVE_NODE_CPUS`` where set (``tpserve serve`` sets it before it
  starts a local Ray on `serving_cores`, so that Ray's processes inherit a narrower set than
  the ranks may claim from), else this process's affinity.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

REGISTRY_ENV = "TPSERVE_CORE_REGISTRY"
NODE_CPUS_ENV = "TPSERVE_NODE_CPUS"
RESERVED_CORES = 1  # cores of a node no rank may claim
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CoreBinding:
    """A rank process's claim: the cores it runs on, the node's cores left unclaimed, and the
    nice value its threads run at."""

    cores: Tuple[int, ...]
    unclaimed: Tuple[int, ...]
    nice: int = 0


def registry_path() -> Path:
    """The host's registry of claims."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV])
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "tpserve-cores.json"


def node_cpus() -> Tuple[int, ...]:
    """The cores ranks on this node may claim (`$TPSERVE_NODE_CPUS`, else this process's)."""
    listed = os.environ.get(NODE_CPUS_ENV)
    if listed:
        return parse_cpu_list(listed)
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_cpu_list(text: str) -> Tuple[int, ...]:
    """``"0-3,6"`` as ``(0, 1, 2, 3, 6)``; ``ValueError`` naming a malformed entry."""
    cores = set()
    for entry in text.split(","):
        low, dash, high = entry.strip().partition("-")
        if not low.isdigit() or (dash and (not high.isdigit() or int(high) < int(low))):
            raise ValueError(f"{NODE_CPUS_ENV}={text!r}: {entry!r} is not a core or a range "
                             "of cores (expected a list like '0-3,6')")
        cores.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: Iterable[int]) -> str:
    return ",".join(str(core) for core in sorted(cores))


def cpu_quota(root: Path = CGROUP_ROOT) -> Optional[float]:
    """The CPUs a cgroup quota allows this process (cgroup v2 ``cpu.max``, else v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None without a quota."""
    try:
        quota, _, period = (root / "cpu.max").read_text().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        try:
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            period = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 else quota / period
    return None


def _shared_by_quota(cpus: Sequence[int]) -> bool:
    quota = cpu_quota()
    if quota is not None and quota < len(cpus):
        logger.info("CPU binding: none: a cgroup quota of %.1f CPUs shares this node's %d cores "
                    "with other containers (give it a cpuset, e.g. Kubernetes' static CPU "
                    "manager, to bind)", quota, len(cpus))
        return True
    return False


def bind_rank_cores(num_threads: int, reserve: int = RESERVED_CORES,
                    registry: Optional[Path] = None, nice: int = 0) -> Optional[CoreBinding]:
    """Claims ``num_threads`` cores for this process and runs all of its threads there, at
    ``nice`` where it may (`set_process_nice`); None (logged) where the node cannot spare them."""
    cpus = node_cpus()
    if _shared_by_quota(cpus):
        return None
    path = registry or registry_path()
    try:
        with _Registry(path) as claims:
            taken = claims.taken()
            free = [core for core in cpus if core not in taken]
            if len(free) - num_threads < reserve:
                logger.info("CPU binding: none for this rank: %d of the node's %d cores are "
                            "unclaimed; %d for its threads and %d for the rest are needed",
                            len(free), len(cpus), num_threads, reserve)
                return None
            cores = tuple(free[:num_threads])
            claims.add(os.getpid(), cores)
    except OSError as exc:
        logger.warning("CPU binding: none for this rank: the core registry %s: %s", path, exc)
        return None
    try:
        pin_process(cores)
    except OSError as exc:  # a core this process may not run on ($TPSERVE_NODE_CPUS)
        logger.warning("CPU binding: none for this rank: cores %s: %s",
                       format_cpu_list(cores), exc)
        release_cores(path)
        return None
    binding = CoreBinding(cores, tuple(free[num_threads:]), set_process_nice(nice))
    logger.info("CPU binding: this rank runs on core(s) %s at nice %d; %s left to the rest",
                format_cpu_list(binding.cores), binding.nice, format_cpu_list(binding.unclaimed))
    return binding


def release_cores(registry: Optional[Path] = None) -> None:
    """Drops this process's claim (a claim of an exited process is dropped anyway)."""
    with _Registry(registry or registry_path()) as claims:
        claims.remove(os.getpid())


def serving_cores(num_ranks: int, threads_per_rank: int = 1, reserve: int = RESERVED_CORES,
                  cpus: Optional[Sequence[int]] = None,
                  registry: Optional[Path] = None) -> Optional[Tuple[int, ...]]:
    """The cores that ``num_ranks`` ranks about to claim would leave unclaimed (None where they
    could not all claim theirs): where the rest of a server should run."""
    cpus = tuple(cpus) if cpus is not None else node_cpus()
    if _shared_by_quota(cpus):
        return None
    try:
        with _Registry(registry or registry_path()) as claims:
            taken = claims.taken()
            free = [core for core in cpus if core not in taken]
    except OSError as exc:
        logger.warning("CPU binding: the core registry: %s", exc)
        return None
    wanted = num_ranks * threads_per_rank
    if len(free) - wanted < reserve:
        return None
    return tuple(free[wanted:])


def pin_process(cores: Iterable[int]) -> None:
    """Every thread of this process, and every thread it starts, runs only on ``cores``."""
    cores = set(cores)
    for tid in sorted(int(name) for name in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def set_process_nice(nice: int) -> int:
    """Every thread of this process, and every thread it starts, at ``nice`` (-20..19; 0 leaves
    the process as it is). Where the process may not raise its priority that far, it keeps the
    one it has (logged). Returns the nice value its threads run at."""
    if not -20 <= nice <= 19:
        raise ValueError(f"nice must be from -20 to 19, got {nice}")
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == 0 or nice == current:
        return current
    for tid in sorted(int(name) for name in os.listdir("/proc/self/task")):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as exc:
            logger.warning("CPU binding: this rank stays at nice %d: it may not take nice %d "
                           "(%s); give it CAP_SYS_NICE (or RLIMIT_NICE) to run above the other "
                           "processes on its cores, or --cpu-rank-nice 0 not to ask", current,
                           nice, exc.strerror)
            return current
    return nice


def process_start_time(pid: int) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot; field 22 of its stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19])


class _Registry:
    """The registry file, locked, its live claims loaded; written back on a clean exit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._claims: List[Dict] = []
        self._changed = False

    def __enter__(self) -> "_Registry":
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            data = json.loads(os.pread(self._fd, 1 << 20, 0) or b"{}")
            claims = data.get("claims", []) if isinstance(data, dict) else []
        except ValueError:  # a torn or foreign file: start afresh
            claims, self._changed = [], True
        self._claims = [claim for claim in claims if _is_live(claim)]
        self._changed |= len(self._claims) != len(claims)
        return self

    def taken(self) -> set:
        return {core for claim in self._claims for core in claim["cores"]}

    def add(self, pid: int, cores: Sequence[int]) -> None:
        self.remove(pid)
        self._claims.append({"pid": pid, "start": process_start_time(pid), "cores": list(cores)})
        self._changed = True

    def remove(self, pid: int) -> None:
        kept = [claim for claim in self._claims if claim["pid"] != pid]
        self._changed |= len(kept) != len(self._claims)
        self._claims = kept

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None and self._changed:
                data = json.dumps({"claims": self._claims}).encode()
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, data, 0)
        finally:
            os.close(self._fd)  # and with it the lock


def _is_live(claim: Dict) -> bool:
    try:
        start = process_start_time(int(claim["pid"]))
        return start is not None and start == claim["start"]
    except (KeyError, TypeError, ValueError):
        return False
