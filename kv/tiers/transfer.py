"""The copy machinery of one rank: carries out tier ops off the compute path, in ticket order.

Rank 0 issues ops (``kv.tiers.ops``) in every step plan; each rank ``submit``s them to its
``TransferEngine``, whose worker thread runs them first in, first out, and ``agree`` tells every
rank which tickets are done on all ranks and the worst status any rank saw for each::

    submit(ops) --queue--> worker: runs of one kind --> statuses of tickets, in order
                                                              |
    agree(cpu_group): all_reduce MIN(num_done) -> agreed; all_reduce MAX(statuses[committed:agreed])

The worker keeps a checksum table per tier (slot -> tag, checksum of the bytes written there) and
refuses bytes whose tag or checksum no longer match; the disk ops and the disk's table are
``kv/tiers/disk/transfer.py``'s. A failed op leaves its destination slot without an entry (a failed
restore's device block may hold the bad bytes and is not attended to), so later ops that name that
slot fail too instead of moving garbage.

Failures come in two kinds. Expected ones (an I/O error, a block's copy failing, bytes that do
not match) fail their ops only, as statuses, and the blocks are recomputed. Anything that escapes
an op is a bug or a broken device, after which the worker's tables and counters cannot be
trusted: the worker stops and every wait and later call raises ``TransferError``, naming the op
and the cause (``kv/tiers/transfer_progress.py``), so the engine step fails instead of hanging every
rank. A wait that outlasts ``wait_timeout_s`` fails the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from kv.integrity.block_checksum import BlockChecksum, index_identity
from kv.tiers.block_copier import BlockCopier
from kv.tiers.disk.transfer import DiskTransfer, SlotEntry
from kv.tiers.disk.store import DiskStore
from kv.tiers.disk.striped import StripedDiskStore
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache
from kv.tiers.ops import (OpStatus, ReadDisk, Restore, SaveIndex, Spill, TierOp, TierOpResults,
                         WriteDisk)
from kv.tiers.transfer_progress import TransferProgress
from parallel.latency import LatencyRecorder

logger = logging.getLogger(__name__)

_OP_KINDS = (Spill, Restore, WriteDisk, ReadDisk, SaveIndex)


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
    ``kv.integrity.block_checksum``); its name is part of the disk index's identity.
    ``staged``: copy through a device staging buffer (``kv.tiers.block_staging``; default on
    CUDA, and on CPU for tests).
    Every wait raises ``TransferError`` once the worker has failed, or when what it waits for is
    not done within ``wait_timeout_s`` (generous: a stuck device, not a slow one).
    """

    def __init__(self, kv_cache: KVCache, host: HostBuffer,
                 disk: Optional[Union[DiskStore, StripedDiskStore]] = None,
                 index_path: Optional[Path] = None, identity: str = "",
                 wait_timeout_s: float = 600.0, checksum: Optional[BlockChecksum] = None,
                 staged: Optional[bool] = None) -> None:
        if host.block_nbytes != kv_cache.spec.bytes_per_block:
            raise ValueError(f"host slots hold {host.block_nbytes} bytes, expected the KV "
                             f"cache's {kv_cache.spec.bytes_per_block} bytes per block")
        if disk is not None and disk.slot_bytes != host.slot_bytes:
            raise ValueError(f"disk slots hold {disk.slot_bytes} bytes, expected the host "
                             f"buffer's slot_bytes={host.slot_bytes}")
        self._progress = TransferProgress(wait_timeout_s)
        self._kv = kv_cache
        self._host = host
        self._is_cuda = kv_cache.data.is_cuda
        # Default priority: a low-priority copy stream starved by compute can deadlock a step
        # that waits for its restores.
        self._copy_stream = torch.cuda.Stream(kv_cache.data.device) if self._is_cuda else None
        self._copier = BlockCopier(kv_cache, host, _copy_threads(), checksum, staged)
        self.checksum = self._copier.checksum
        self.staging = self._copier.staging  # None: copied by numpy on the copier's threads
        # Owned by the worker thread once it starts (the disk side shares the host table).
        self._host_entries: Dict[int, SlotEntry] = {}
        self._disk = None if disk is None else DiskTransfer(
            disk, host, self._copier, self._host_entries, index_path,
            index_identity(identity, self.checksum.name))

        self.num_bytes_spilled = 0
        self.num_bytes_restored = 0
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

    @property
    def num_bytes_disk_written(self) -> int:
        return 0 if self._disk is None else self._disk.num_bytes_written

    @property
    def num_bytes_disk_read(self) -> int:
        return 0 if self._disk is None else self._disk.num_bytes_read

    def disk_tags(self) -> Dict[int, int]:
        """Disk slot -> tag of the blocks this rank holds on disk, after the queued ops."""
        self.wait_all()
        entries = {} if self._disk is None else self._disk.entries
        return {slot: entry.tag for slot, entry in entries.items()}

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
        if self._disk is not None:
            self._disk.close()

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
        refusal = self._refusal(ops[0])
        if refusal is not None:
            logger.error("%d %s ops refused: %s", len(ops), type(ops[0]).__name__, refusal)
            return [OpStatus.IO_ERROR] * len(ops)
        handlers: Dict[type, Callable[[List], List[OpStatus]]] = {
            Spill: self._spill, Restore: self._restore}
        if self._disk is not None:  # else _refusal refused the disk ops
            handlers.update({WriteDisk: self._disk.write, ReadDisk: self._disk.read,
                             SaveIndex: self._disk.save_index})
        return handlers[type(ops[0])](ops)

    def _refusal(self, op: TierOp) -> Optional[str]:
        """Why this rank cannot run ``op`` at all (an IO_ERROR, not a failure), or None."""
        if isinstance(op, (WriteDisk, ReadDisk, SaveIndex)) and self._disk is None:
            return "this rank has no disk store"
        if isinstance(op, SaveIndex) and self._disk.index_path is None:
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
            self._host_entries[op.host_slot] = SlotEntry(op.tag, checksum)
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

    # --- helpers -----------------------------------------------------------------------------

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

def _copy_threads() -> int:
    """Threads that copy and hash blocks: the cores torch computes on, at most four."""
    return max(1, min(4, torch.get_num_threads(), os.cpu_count() or 1))
