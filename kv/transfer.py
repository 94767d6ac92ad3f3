"""The copy machinery of one rank: carries out tier ops off the compute path, in ticket order.

Rank 0 issues ops (``kv.tier_ops``) in every step plan; each rank ``submit``s them to its
``TransferEngine``, whose worker thread runs them first in, first out, and ``agree`` tells every
rank which tickets are done on all ranks and the worst status any rank saw for each::

    submit(ops) --queue--> worker: runs of one kind --> statuses of tickets, in order
                                                              |
    agree(cpu_group): all_reduce MIN(num_done) -> agreed; all_reduce MAX(statuses[committed:agreed])

The worker keeps a checksum table per tier (slot -> tag, checksum of the bytes written there) and
refuses bytes whose tag or checksum no longer match. A failed op leaves its destination slot
without an entry (a failed restore's device block may hold the bad bytes and is not attended
to), so later ops that name that slot fail too instead of moving garbage.

Failures come in two kinds. Expected ones (an I/O error, a block's copy failing, bytes that do
not match) fail their ops only, as statuses, and the blocks are recomputed. Anything that escapes
an op is a bug or a broken device, after which the worker's tables and counters cannot be
trusted: the worker stops and every wait and later call raises ``TransferError``, naming the op
and the cause (``kv/transfer_progress.py``), so the engine step fails instead of hanging every
rank. A wait that outlasts ``wait_timeout_s`` fails the same way.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from kv.block_checksum import BlockChecksum, index_identity
from kv.block_copier import BlockCopier
from kv.disk_index import read_snapshot, write_snapshot
from kv.disk_store import DiskStore
from kv.striped_disk import StripedDiskStore
from kv.host_buffer import HostBuffer
from kv.kv_cache import KVCache
from kv.tier_ops import (OpStatus, ReadDisk, Restore, SaveIndex, Spill, TierOp, TierOpResults,
                         WriteDisk)
from kv.transfer_progress import TransferProgress
from parallel.latency import LatencyRecorder

logger = logging.getLogger(__name__)

INDEX_KIND = "disk-checksums"
# Disk calls in flight: keeps the device busy while a chunk is verified (a striped store runs
# each call's parts on all its drives at once, so each drive has as many).
_IO_DEPTH = 2
_OP_KINDS = (Spill, Restore, WriteDisk, ReadDisk, SaveIndex)


@dataclass(frozen=True)
class _Entry:
    """What a slot holds: the block's tag and the checksum of its bytes."""

    tag: int
    checksum: int


@dataclass(frozen=True)
class _Batch:
    """The ops of one ``submit`` call."""

    ops: Sequence[TierOp]
    submitted_at: float
    compute_done: Optional[torch.cuda.Event]  # CUDA only: compute work issued before submit


def split_runs(ops: Sequence[TierOp]) -> List[List[TierOp]]:
    """Cut ``ops`` into runs of consecutive ops of one kind that may run as one group.

    A run ends where an op's destination slot repeats, so the ops of a run commute (each kind
    reads one tier and writes another) and a group may issue them in any order. O(n).
    """
    runs: List[List[TierOp]] = []
    destinations: set = set()
    for op in ops:
        destination = _destination(op)
        if runs and type(runs[-1][0]) is type(op) and destination not in destinations:
            runs[-1].append(op)
            destinations.add(destination)
        else:
            runs.append([op])
            destinations = {destination}
    return runs


def _destination(op: TierOp) -> Optional[int]:
    if isinstance(op, (Spill, ReadDisk)):
        return op.host_slot
    if isinstance(op, Restore):
        return op.device_block
    if isinstance(op, WriteDisk):
        return op.disk_slot
    return None  # SaveIndex: never grouped


class TransferEngine:
    """Carries out one rank's tier ops first in, first out, off the compute path.

    ``submit`` returns at once; one worker thread runs the ops in ticket order (op ``i`` ever
    submitted has ticket ``i``), consecutive ops of one kind as one group: one device
    synchronization per group of copies, one coalesced disk call per group of disk ops. On CUDA
    the copies run on their own stream after the compute work issued before ``submit``.
    Neither the host buffer nor the disk store is owned: the caller closes them after ``close``.
    ``checksum``: the block checksum strategy (default: chosen for the pool's device, see
    ``kv.block_checksum``); its name is part of the disk index's identity.
    Every wait raises ``TransferError`` once the worker has failed, or when what it waits for is
    not done within ``wait_timeout_s`` (generous: a stuck device, not a slow one).
    """

    def __init__(self, kv_cache: KVCache, host: HostBuffer,
                 disk: Optional[Union[DiskStore, StripedDiskStore]] = None,
                 index_path: Optional[Path] = None, identity: str = "",
                 wait_timeout_s: float = 600.0, checksum: Optional[BlockChecksum] = None) -> None:
        if host.block_nbytes != kv_cache.spec.bytes_per_block:
            raise ValueError(f"host slots hold {host.block_nbytes} bytes, expected the KV "
                             f"cache's {kv_cache.spec.bytes_per_block} bytes per block")
        if disk is not None and disk.slot_bytes != host.slot_bytes:
            raise ValueError(f"disk slots hold {disk.slot_bytes} bytes, expected the host "
                             f"buffer's slot_bytes={host.slot_bytes}")
        self._progress = TransferProgress(wait_timeout_s)
        self._kv = kv_cache
        self._host = host
        self._disk = disk
        self._index_path = index_path
        self._is_cuda = kv_cache.data.is_cuda
        # Default priority: a low-priority copy stream starved by compute can deadlock a step
        # that waits for its restores.
        self._copy_stream = torch.cuda.Stream(kv_cache.data.device) if self._is_cuda else None
        self._copier = BlockCopier(kv_cache, host, _copy_threads(), checksum)
        self.checksum = self._copier.checksum
        self._identity = index_identity(identity, self.checksum.name)
        self._io = ThreadPoolExecutor(_IO_DEPTH, thread_name_prefix="tpserve-kv-io")
        # Owned by the worker thread once it starts.
        self._host_entries: Dict[int, _Entry] = {}
        self._disk_entries: Dict[int, _Entry] = (
            self._load_index() if disk is not None and index_path is not None else {})

        self.num_bytes_spilled = 0
        self.num_bytes_restored = 0
        self.num_bytes_disk_written = 0
        self.num_bytes_disk_read = 0
        self.transfer_latency = LatencyRecorder()  # seconds from submit to done, per batch

        self._queue: "queue.Queue[Optional[_Batch]]" = queue.Queue()
        self._is_closed = False
        self._worker = threading.Thread(target=self._work, name="tpserve-kv-transfer",
                                        daemon=True)
        self._worker.start()

    # --- caller side -------------------------------------------------------------------------

    @property
    def num_submitted(self) -> int:
        return self._progress.num_submitted

    @property
    def num_committed(self) -> int:
        return self._progress.num_committed

    @property
    def num_outstanding(self) -> int:
        return self.num_submitted - self.num_committed

    def submit(self, ops: Sequence[TierOp]) -> None:
        """Queue ``ops`` (tickets ``num_submitted..``); returns at once. Raises
        ``TransferError`` if the worker has failed."""
        if self._is_closed:
            raise RuntimeError("TransferEngine.submit after close")
        for op in ops:
            if not isinstance(op, _OP_KINDS):
                raise TypeError(f"TransferEngine.submit: {op!r} is not a tier op, expected one of "
                                f"{', '.join(kind.__name__ for kind in _OP_KINDS)}")
        if not ops:
            return
        compute_done = None
        if self._is_cuda:
            compute_done = torch.cuda.Event()
            compute_done.record(torch.cuda.current_stream(self._kv.data.device))
        self._progress.add_submitted(len(ops), sum(1 for op in ops if isinstance(op, Spill)))
        self._queue.put(_Batch(list(ops), time.perf_counter(), compute_done))

    def wait_device_reads(self) -> None:
        """Return once the device blocks of every submitted spill have been read, so the caller's
        next compute may overwrite them: on CPU the copies are done; on CUDA the compute stream
        is made to wait for them (the host does not wait for the GPU). Raises
        ``TransferError`` if the worker failed or the reads are not done in ``wait_timeout_s``."""
        event = self._progress.wait_device_reads()
        if self._is_cuda and event is not None:
            torch.cuda.current_stream(self._kv.data.device).wait_event(event)

    def num_done(self) -> int:
        """Length of the completed prefix of tickets (ops finish in ticket order)."""
        return self._progress.num_done()

    def wait_all(self) -> None:
        """Block until every submitted op is done; raises like ``wait_device_reads``."""
        self._progress.wait_all()

    def agree(self, cpu_group: Optional[dist.ProcessGroup], wait: bool) -> TierOpResults:
        """Commit the tickets done on every rank; their statuses are the worst across ranks.

        A collective over ``cpu_group`` (two small all-reduces): every rank calls it at the same
        points. With ``wait`` it first waits for all of this rank's ops. Raises
        ``TransferError`` if this rank's worker failed (before the collectives: the other ranks
        then fail at theirs when this rank's process goes).
        """
        if wait:
            self.wait_all()
        self._progress.check()
        first = self.num_committed
        agreed = self.num_done()
        if cpu_group is not None:
            count = torch.tensor([agreed], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=cpu_group)
            agreed = int(count.item())
        statuses = self._progress.take(agreed)
        if cpu_group is not None and statuses:
            worst = torch.tensor([int(s) for s in statuses], dtype=torch.uint8)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=cpu_group)
            statuses = [OpStatus(int(s)) for s in worst.tolist()]
        return TierOpResults(first_ticket=first, statuses=tuple(statuses))

    def disk_tags(self) -> Dict[int, int]:
        """Disk slot -> tag of the blocks this rank holds on disk, after the queued ops."""
        self.wait_all()
        return {slot: entry.tag for slot, entry in self._disk_entries.items()}

    def close(self) -> None:
        """Finish the queued ops (none after a failure) and stop the worker; idempotent. Waits at
        most ``wait_timeout_s`` (a second once failed: a wait has already timed out, or the worker
        has ended): a worker stuck in a copy or an I/O call is left running (a daemon thread)
        rather than hanging the caller."""
        if self._is_closed:
            return
        self._is_closed = True
        self._queue.put(None)
        timeout_s = self._progress.timeout_s
        if self._progress.is_failed:
            timeout_s = min(1.0, timeout_s)
        self._worker.join(timeout_s)
        if self._worker.is_alive():
            self._progress.fail(f"close: the transfer worker did not stop within {timeout_s:g} s",
                                None)
            return
        self._copier.close()
        self._io.shutdown(wait=True)

    # --- worker side -------------------------------------------------------------------------

    def _work(self) -> None:
        """Run batches until ``close``. Whatever raises here fails the progress and ends the
        thread: the tables and counters it may have left half updated are not trusted again."""
        what = "the transfer loop"
        try:
            while (batch := self._queue.get()) is not None:
                if batch.compute_done is not None:
                    self._copy_stream.wait_event(batch.compute_done)
                for run in split_runs(batch.ops):
                    first = self._progress.num_done()
                    what = (f"{type(run[0]).__name__} x{len(run)} "
                            f"(tickets {first}..{first + len(run) - 1})")
                    self._progress.finish(self._run_group(run))
                what = "the transfer loop"
                self.transfer_latency.record(time.perf_counter() - batch.submitted_at)
        except BaseException as exc:  # any exit but close must wake the waiters
            self._progress.fail(f"the worker raised running {what}: {type(exc).__name__}: "
                                f"{exc}", exc)

    def _run_group(self, ops: List[TierOp]) -> List[OpStatus]:
        handlers: Dict[type, Callable[[List], List[OpStatus]]] = {
            Spill: self._spill, Restore: self._restore, WriteDisk: self._write_disk,
            ReadDisk: self._read_disk, SaveIndex: self._save_index,
        }
        refusal = self._refusal(ops[0])
        if refusal is not None:
            logger.error("%d %s ops refused: %s", len(ops), type(ops[0]).__name__, refusal)
            return [OpStatus.IO_ERROR] * len(ops)
        return handlers[type(ops[0])](ops)

    def _refusal(self, op: TierOp) -> Optional[str]:
        """Why this rank cannot run ``op`` at all (an IO_ERROR, not a failure), or None."""
        if isinstance(op, (WriteDisk, ReadDisk, SaveIndex)) and self._disk is None:
            return "this rank has no disk store"
        if isinstance(op, SaveIndex) and self._index_path is None:
            return "this rank's TransferEngine has no index_path"
        return None

    def _spill(self, ops: List[Spill]) -> List[OpStatus]:
        for op in ops:
            self._host_entries.pop(op.host_slot, None)
        with self._on_copy_stream():
            checksums = self._copier.copy_out([(op.device_block, op.host_slot) for op in ops],
                                              lambda: self._mark_spills_read(len(ops)))
        statuses = []
        for op, checksum in zip(ops, checksums):
            if checksum is None:
                statuses.append(OpStatus.IO_ERROR)
                continue
            self._host_entries[op.host_slot] = _Entry(op.tag, checksum)
            self.num_bytes_spilled += self._host.block_nbytes
            statuses.append(OpStatus.OK)
        return statuses

    def _restore(self, ops: List[Restore]) -> List[OpStatus]:
        expected = []
        for op in ops:
            entry = self._host_entries.get(op.host_slot)
            expected.append(entry.checksum if entry is not None and entry.tag == op.tag else None)
        with self._on_copy_stream():
            written = self._copier.copy_in([(op.host_slot, op.device_block, checksum)
                                            for op, checksum in zip(ops, expected)])
        self.num_bytes_restored += self._host.block_nbytes * sum(1 for ok in written if ok)
        # None: the copy itself failed (logged by the copier).
        return [OpStatus.IO_ERROR if ok is None else OpStatus.OK if ok else OpStatus.CHECKSUM
                for ok in written]

    def _write_disk(self, ops: List[WriteDisk]) -> List[OpStatus]:
        disk = self._disk
        assert disk is not None
        statuses = [self._check_disk_op(op) for op in ops]
        for op in ops:
            self._disk_entries.pop(op.disk_slot, None)
        todo = []
        for i, op in enumerate(ops):
            entry = self._host_entries.get(op.host_slot)
            if statuses[i] is OpStatus.OK and (entry is None or entry.tag != op.tag):
                statuses[i] = OpStatus.CHECKSUM
            elif statuses[i] is OpStatus.OK:
                todo.append(i)
        # Chunks of consecutive disk slots, each about one large I/O, _IO_DEPTH in flight.
        todo.sort(key=lambda i: ops[i].disk_slot)
        chunks = self._io_chunks(todo)
        write = lambda chunk: disk.write([ops[i].disk_slot for i in chunk],  # noqa: E731
                                         [self._host.view(ops[i].host_slot) for i in chunk])
        errors = [error for chunk_errors in self._io.map(write, chunks) for error in chunk_errors]
        for i, error in zip(todo, errors):
            op = ops[i]
            if error is not None:
                logger.error("writing host slot %d to disk slot %d failed: %s",
                             op.host_slot, op.disk_slot, error)
                statuses[i] = OpStatus.IO_ERROR
                continue
            self._disk_entries[op.disk_slot] = self._host_entries[op.host_slot]
            self.num_bytes_disk_written += disk.slot_bytes
        return statuses

    def _read_disk(self, ops: List[ReadDisk]) -> List[OpStatus]:
        disk = self._disk
        assert disk is not None
        statuses = [self._check_disk_op(op) for op in ops]
        for op in ops:
            self._host_entries.pop(op.host_slot, None)
        todo = []
        for i, op in enumerate(ops):
            entry = self._disk_entries.get(op.disk_slot)
            if statuses[i] is OpStatus.OK and (entry is None or entry.tag != op.tag):
                statuses[i] = OpStatus.CHECKSUM  # no need to read bytes that cannot match
            elif statuses[i] is OpStatus.OK:
                todo.append(i)
        # Chunks of about one large I/O, _IO_DEPTH of them in flight; each chunk is verified
        # while the next ones are read.
        todo.sort(key=lambda i: ops[i].disk_slot)
        chunks = self._io_chunks(todo)
        read = lambda chunk: disk.read([ops[i].disk_slot for i in chunk],  # noqa: E731
                                       [self._host.view(ops[i].host_slot) for i in chunk])
        pending = collections.deque(self._io.submit(read, c) for c in chunks[:_IO_DEPTH])
        for index, chunk in enumerate(chunks):
            errors = pending.popleft().result()
            if index + _IO_DEPTH < len(chunks):
                pending.append(self._io.submit(read, chunks[index + _IO_DEPTH]))
            self._verify_reads([ops[i] for i in chunk], errors, chunk, statuses)
        return statuses

    def _io_chunks(self, todo: List[int]) -> List[List[int]]:
        """``todo`` (already in disk slot order) cut into chunks of about one large I/O each."""
        assert self._disk is not None
        per_chunk = max(1, self._disk.max_io_bytes // self._disk.slot_bytes)
        return [todo[i:i + per_chunk] for i in range(0, len(todo), per_chunk)]

    def _verify_reads(self, ops: List[ReadDisk], errors: List[Optional[OSError]],
                      indices: List[int], statuses: List[OpStatus]) -> None:
        """Check the checksums of blocks just read from disk (hashed on the copier's threads)."""
        read_ok = [op for op, error in zip(ops, errors) if error is None]
        sums = iter(self._copier.checksums([op.host_slot for op in read_ok]))
        for index, op, error in zip(indices, ops, errors):
            if error is not None:
                logger.error("reading disk slot %d into host slot %d failed: %s",
                             op.disk_slot, op.host_slot, error)
                statuses[index] = OpStatus.IO_ERROR
                continue
            self.num_bytes_disk_read += self._host.slot_bytes
            entry = self._disk_entries[op.disk_slot]
            if next(sums) != entry.checksum:
                logger.warning("disk slot %d: checksum mismatch for tag %#x", op.disk_slot,
                               op.tag)
                statuses[index] = OpStatus.CHECKSUM
                continue
            self._host_entries[op.host_slot] = entry
            statuses[index] = OpStatus.OK

    def _save_index(self, ops: List[SaveIndex]) -> List[OpStatus]:
        assert self._disk is not None and self._index_path is not None
        records = [[slot, entry.tag, entry.checksum]
                   for slot, entry in sorted(self._disk_entries.items())]
        try:
            self._disk.sync()
            write_snapshot(self._index_path, INDEX_KIND, self._identity, records)
        except OSError as exc:  # a full or failing disk: the next snapshot may succeed
            logger.error("saving the disk index to %s failed: %s", self._index_path, exc)
            return [OpStatus.IO_ERROR] * len(ops)
        return [OpStatus.OK] * len(ops)

    # --- helpers -----------------------------------------------------------------------------

    def _check_disk_op(self, op: TierOp) -> OpStatus:
        """OK if the op's slots exist; else IO_ERROR (logged) without failing its group."""
        if 0 <= op.host_slot < self._host.num_slots and 0 <= op.disk_slot < self._disk.num_slots:
            return OpStatus.OK
        logger.error("%s: slot out of range (%d host slots, %d disk slots)",
                     op, self._host.num_slots, self._disk.num_slots)
        return OpStatus.IO_ERROR

    def _on_copy_stream(self) -> contextlib.AbstractContextManager:
        if self._copy_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._copy_stream)

    def _mark_spills_read(self, num_ops: int) -> None:
        """Release ``wait_device_reads`` for these spills (checksums still to come)."""
        event = None
        if self._copy_stream is not None:
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._progress.mark_spills_read(num_ops, event)

    def _load_index(self) -> Dict[int, _Entry]:
        records = read_snapshot(self._index_path, INDEX_KIND, self._identity) or []
        entries: Dict[int, _Entry] = {}
        for record in records:
            if not _is_index_record(record, self._disk.num_slots):
                logger.warning("%s: record %r is not [slot, tag, checksum] with 0 <= slot < %d; "
                               "ignored", self._index_path, record, self._disk.num_slots)
                continue
            slot, tag, checksum = record
            entries[slot] = _Entry(tag, checksum)
        return entries


def _is_index_record(record: object, num_slots: int) -> bool:
    return (isinstance(record, list) and len(record) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in record)
            and 0 <= record[0] < num_slots)


def _copy_threads() -> int:
    """Threads that copy and hash blocks: the cores torch computes on, at most four."""
    return max(1, min(4, torch.get_num_threads(), os.cpu_count() or 1))
