"""One rank's disk tier striped over several directories (one drive each), RAID-0 style.

The global slots are cut into stripe units of ``unit_slots`` consecutive slots, and the units go to
the directories in turn, so a stream of writes wears every drive alike and a large batch keeps
every drive busy. Each directory holds one ``DiskStore`` file of its own (local) slots::

    unit_slots = 4, directories a b c
    global slot   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 17 ...
    unit              0   |    1    |     2     |      3      |   4
    directory         a   |    b    |     c     |      a      |   b
    local slot    0 1 2 3 | 0 1 2 3 | 0 1  2  3 | 4  5  6  7  | 4  5 ...

    unit u = s // unit_slots     directory d = u % n
    local slot = (u // n) * unit_slots + s % unit_slots

A unit is one large I/O (``max_io_bytes``, 8 MiB by default), so consecutive slots inside a unit
still coalesce into one ``pwritev``/``preadv``, and consecutive global slots across a unit boundary
are consecutive in no file: they are two calls, on two drives, run at the same time. With few slots
the unit shrinks (``num_slots // n``) so that every directory holds at least one unit.

A single directory is exactly the plain ``DiskStore``: the same file, slot ``s`` at byte
``s * slot_bytes``. I/O errors stay per slot, and per directory: a failing drive fails the slots
that live on it, never those of the others.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from kv.tiers.disk.store import DiskStore


@dataclass(frozen=True)
class StripeLayout:
    """Where global slot ``s`` lives: ``(directory, local slot)``; pure arithmetic, O(1) a slot."""

    num_slots: int
    num_dirs: int
    unit_slots: int

    def __post_init__(self) -> None:
        if self.num_dirs < 1 or self.unit_slots < 1:
            raise ValueError(f"StripeLayout: num_dirs={self.num_dirs}, unit_slots="
                             f"{self.unit_slots}, expected both at least 1")
        if self.num_slots < self.num_dirs:
            raise ValueError(f"the disk tier holds {self.num_slots} blocks, fewer than its "
                             f"{self.num_dirs} directories: raise --disk-kv-gb/--disk-kv-blocks "
                             f"or list fewer directories")

    def locate(self, slot: int) -> Tuple[int, int]:
        """``(directory index, local slot)`` of global ``slot``."""
        unit, offset = divmod(slot, self.unit_slots)
        return unit % self.num_dirs, (unit // self.num_dirs) * self.unit_slots + offset

    def global_slot(self, directory: int, local: int) -> int:
        """The inverse of :meth:`locate`."""
        row, offset = divmod(local, self.unit_slots)
        return (row * self.num_dirs + directory) * self.unit_slots + offset

    def num_local_slots(self, directory: int) -> int:
        """Slots that live in ``directory`` (its file's size in slots). Its local slots are
        ``0..count-1`` with no hole: only the last unit overall can be partial, and it is the
        last of its directory."""
        num_full, remainder = divmod(self.num_slots, self.unit_slots)
        num_units = num_full // self.num_dirs + int(directory < num_full % self.num_dirs)
        count = num_units * self.unit_slots
        if remainder and directory == num_full % self.num_dirs:
            count += remainder
        return count


def stripe_unit_slots(num_slots: int, slot_bytes: int, num_dirs: int, max_io_bytes: int) -> int:
    """Slots per stripe unit: one large I/O (``max_io_bytes``), but small enough that each of the
    ``num_dirs`` directories gets at least one unit of the ``num_slots``."""
    return max(1, min(max_io_bytes // slot_bytes, num_slots // num_dirs))


class StripedDiskStore:
    """The ``DiskStore`` interface over ``paths`` (one file per directory), striped by
    :class:`StripeLayout`; one path is a plain ``DiskStore`` in all but the name.

    ``write``/``read`` split a batch by directory and run the parts at once: the caller's thread
    does the first, a pool of ``io_depth`` threads per further directory the others (a caller
    with ``io_depth`` calls in flight keeps that many on every drive). ``max_io_bytes`` is what
    one call should carry to keep them all busy: a full stripe, one large I/O per directory.
    Calls on disjoint slots may run from several threads at once, like ``DiskStore``'s.
    """

    def __init__(self, paths: Sequence[Path], num_slots: int, slot_bytes: int,
                 max_io_bytes: int = 8 << 20, io_depth: int = 2) -> None:
        if not paths:
            raise ValueError("StripedDiskStore: no paths, expected at least one file")
        if slot_bytes <= 0 or max_io_bytes <= 0:
            raise ValueError(f"StripedDiskStore: slot_bytes={slot_bytes}, max_io_bytes="
                             f"{max_io_bytes}, expected both positive")
        self.paths = tuple(Path(p) for p in paths)
        self.layout = StripeLayout(num_slots, len(self.paths),
                                   stripe_unit_slots(num_slots, slot_bytes, len(self.paths),
                                                     max_io_bytes))
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.max_io_bytes = max_io_bytes * len(self.paths)
        self.stores: List[DiskStore] = []
        try:
            for index, path in enumerate(self.paths):
                self.stores.append(DiskStore(path, self.layout.num_local_slots(index),
                                             slot_bytes, max_io_bytes))
        except BaseException:
            self.close()
            raise
        self._pool = (ThreadPoolExecutor(io_depth * (len(self.paths) - 1),
                                         thread_name_prefix="tpserve-kv-stripe")
                      if len(self.paths) > 1 else None)

    @property
    def num_dirs(self) -> int:
        return len(self.paths)

    @property
    def is_direct(self) -> bool:
        return all(store.is_direct for store in self.stores)

    @property
    def layout_identity(self) -> str:
        """What a snapshot of slot contents must match to be read with this layout: empty for one
        directory (the plain store's snapshots stay valid), else the unit size and every file's
        resolved path, in order, so another count or order of directories is another identity."""
        if self.num_dirs == 1:
            return ""
        files = "|".join(os.path.realpath(path) for path in self.paths)
        return f"/stripe{self.layout.unit_slots}:{files}"

    @property
    def num_bytes_written(self) -> int:
        return sum(store.num_bytes_written for store in self.stores)

    @property
    def num_bytes_read(self) -> int:
        return sum(store.num_bytes_read for store in self.stores)

    @property
    def num_io_calls(self) -> int:
        return sum(store.num_io_calls for store in self.stores)

    def directory_bytes(self) -> List[Tuple[int, int]]:
        """``(bytes written, bytes read)`` by the kernel calls of each directory, in path order."""
        return [(store.num_bytes_written, store.num_bytes_read) for store in self.stores]

    def write(self, slots: Sequence[int], buffers: Sequence[memoryview]) -> List[Optional[OSError]]:
        """As ``DiskStore.write``: one entry per input, None or the OSError of its slot."""
        return self._transfer(slots, buffers, "write")

    def read(self, slots: Sequence[int], buffers: Sequence[memoryview]) -> List[Optional[OSError]]:
        """As ``DiskStore.read``: one entry per input, None or the OSError of its slot."""
        return self._transfer(slots, buffers, "read")

    def sync(self) -> None:
        """Make written slots durable in every directory (``fdatasync`` each file, at once)."""
        self._run_all([(store.sync, ()) for store in self.stores])

    def close(self) -> None:
        """Close every file; idempotent."""
        for store in self.stores:
            store.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> "StripedDiskStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StripedDiskStore({[str(p) for p in self.paths]}, num_slots={self.num_slots}, "
                f"slot_bytes={self.slot_bytes}, unit_slots={self.layout.unit_slots})")

    def _transfer(self, slots: Sequence[int], buffers: Sequence[memoryview],
                  what: str) -> List[Optional[OSError]]:
        if len(slots) != len(buffers):
            raise ValueError(f"StripedDiskStore: {len(slots)} slots but {len(buffers)} buffers, "
                             f"expected one buffer per slot")
        parts: Dict[int, Tuple[List[int], List[int]]] = {}  # directory -> (positions, local)
        for index, slot in enumerate(slots):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"StripedDiskStore: slot {slot} out of range, expected "
                                 f"0 <= slot < {self.num_slots}")
            directory, local = self.layout.locate(slot)
            positions, local_slots = parts.setdefault(directory, ([], []))
            positions.append(index)
            local_slots.append(local)
        calls = []
        for directory, (positions, local_slots) in parts.items():
            store = self.stores[directory]
            method = store.write if what == "write" else store.read
            calls.append((method, (local_slots, [buffers[i] for i in positions])))
        results: List[Optional[OSError]] = [None] * len(slots)
        for (positions, _), errors in zip(parts.values(), self._run_all(calls)):
            for index, error in zip(positions, errors):
                results[index] = error
        return results

    def _run_all(self, calls: List[tuple]) -> List:
        """Run ``(function, args)`` calls (at most one per directory), the first on this thread
        and the others on the pool; their results in order. All have finished before an
        exception of one is raised."""
        assert len(calls) <= 1 or self._pool is not None
        futures = [self._pool.submit(function, *args) for function, args in calls[1:]]
        try:
            first = [calls[0][0](*calls[0][1])] if calls else []
        finally:
            wait(futures)
        return first + [future.result() for future in futures]
