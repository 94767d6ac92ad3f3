"""The disk half of a rank's `kv.tiers.transfer.TransferEngine`: host slots written to and read from a
disk store, with the disk's checksum table and its index snapshot.

    write(ops)  host slot -> disk slot: the host slot's entry (tag, checksum) goes with the bytes
    read(ops)   disk slot -> host slot: the bytes are hashed again and kept only if they match
    save_index  the disk table, synced and written as a snapshot (``kv.tiers.disk.index``) that a
                restarted rank reloads, so what it spilled to disk stays usable

Disk calls are coalesced: each group of ops is cut into chunks of consecutive disk slots of
about one large I/O each, ``IO_DEPTH`` of them in flight; a chunk just read is verified while
the next ones are read. Expected failures (an I/O error, a slot out of range, bytes that do not
match) fail their ops only, as statuses. Runs on the transfer engine's worker thread only.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Union

from kv.tiers.block_copier import BlockCopier
from kv.tiers.disk.index import read_snapshot, write_snapshot
from kv.tiers.disk.store import DiskStore
from kv.tiers.host_buffer import HostBuffer
from kv.tiers.disk.striped import StripedDiskStore
from kv.tiers.ops import OpStatus, ReadDisk, SaveIndex, TierOp, WriteDisk

logger = logging.getLogger(__name__)

INDEX_KIND = "disk-checksums"
# Disk calls in flight: keeps the device busy while a chunk is verified (a striped store runs
# each call's parts on all its drives at once, so each drive has as many).
IO_DEPTH = 2


@dataclass(frozen=True)
class SlotEntry:
    """What a host or disk slot holds: the block's tag and the checksum of its bytes."""

    tag: int
    checksum: int


class DiskTransfer:
    """Runs the disk ops of one rank. ``host_entries`` is the transfer engine's host table,
    shared: a write reads a slot's entry from it, a verified read puts one in. With an
    ``index_path`` the disk table starts from the snapshot there (records that do not fit are
    logged and ignored)."""

    def __init__(self, disk: Union[DiskStore, StripedDiskStore], host: HostBuffer,
                 copier: BlockCopier, host_entries: Dict[int, SlotEntry],
                 index_path: Optional[Path], identity: str) -> None:
        self._disk = disk
        self._host = host
        self._copier = copier
        self._host_entries = host_entries
        self.index_path = index_path
        self._identity = identity
        self._io = ThreadPoolExecutor(IO_DEPTH, thread_name_prefix="tpserve-kv-io")
        self.entries: Dict[int, SlotEntry] = self._load_index() if index_path is not None else {}
        self.num_bytes_written = 0
        self.num_bytes_read = 0

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def write(self, ops: List[WriteDisk]) -> List[OpStatus]:
        disk = self._disk
        statuses = [self._check(op) for op in ops]
        for op in ops:
            self.entries.pop(op.disk_slot, None)
        todo = []
        for i, op in enumerate(ops):
            entry = self._host_entries.get(op.host_slot)
            if statuses[i] is OpStatus.OK and (entry is None or entry.tag != op.tag):
                statuses[i] = OpStatus.CHECKSUM
            elif statuses[i] is OpStatus.OK:
                todo.append(i)
        todo.sort(key=lambda i: ops[i].disk_slot)
        write = lambda chunk: disk.write([ops[i].disk_slot for i in chunk],  # noqa: E731
                                         [self._host.view(ops[i].host_slot) for i in chunk])
        errors = [error for chunk_errors in self._io.map(write, self._chunks(todo))
                  for error in chunk_errors]
        for i, error in zip(todo, errors):
            op = ops[i]
            if error is not None:
                logger.error("writing host slot %d to disk slot %d failed: %s",
                             op.host_slot, op.disk_slot, error)
                statuses[i] = OpStatus.IO_ERROR
                continue
            self.entries[op.disk_slot] = self._host_entries[op.host_slot]
            self.num_bytes_written += disk.slot_bytes
        return statuses

    def read(self, ops: List[ReadDisk]) -> List[OpStatus]:
        disk = self._disk
        statuses = [self._check(op) for op in ops]
        for op in ops:
            self._host_entries.pop(op.host_slot, None)
        todo = []
        for i, op in enumerate(ops):
            entry = self.entries.get(op.disk_slot)
            if statuses[i] is OpStatus.OK and (entry is None or entry.tag != op.tag):
                statuses[i] = OpStatus.CHECKSUM  # no need to read bytes that cannot match
            elif statuses[i] is OpStatus.OK:
                todo.append(i)
        todo.sort(key=lambda i: ops[i].disk_slot)
        chunks = self._chunks(todo)
        read = lambda chunk: disk.read([ops[i].disk_slot for i in chunk],  # noqa: E731
                                       [self._host.view(ops[i].host_slot) for i in chunk])
        pending = collections.deque(self._io.submit(read, c) for c in chunks[:IO_DEPTH])
        for index, chunk in enumerate(chunks):
            errors = pending.popleft().result()
            if index + IO_DEPTH < len(chunks):
                pending.append(self._io.submit(read, chunks[index + IO_DEPTH]))
            self._verify_reads([ops[i] for i in chunk], errors, chunk, statuses)
        return statuses

    def save_index(self, ops: List[SaveIndex]) -> List[OpStatus]:
        assert self.index_path is not None
        records = [[slot, entry.tag, entry.checksum]
                   for slot, entry in sorted(self.entries.items())]
        try:
            self._disk.sync()
            write_snapshot(self.index_path, INDEX_KIND, self._identity, records)
        except OSError as exc:  # a full or failing disk: the next snapshot may succeed
            logger.error("saving the disk index to %s failed: %s", self.index_path, exc)
            return [OpStatus.IO_ERROR] * len(ops)
        return [OpStatus.OK] * len(ops)

    def _chunks(self, todo: List[int]) -> List[List[int]]:
        """``todo`` (already in disk slot order) cut into chunks of about one large I/O each."""
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
            self.num_bytes_read += self._host.slot_bytes
            entry = self.entries[op.disk_slot]
            if next(sums) != entry.checksum:
                logger.warning("disk slot %d: checksum mismatch for tag %#x", op.disk_slot,
                               op.tag)
                statuses[index] = OpStatus.CHECKSUM
                continue
            self._host_entries[op.host_slot] = entry
            statuses[index] = OpStatus.OK

    def _check(self, op: TierOp) -> OpStatus:
        """OK if the op's slots exist; else IO_ERROR (logged) without failing its group."""
        if 0 <= op.host_slot < self._host.num_slots and 0 <= op.disk_slot < self._disk.num_slots:
            return OpStatus.OK
        logger.error("%s: slot out of range (%d host slots, %d disk slots)",
                     op, self._host.num_slots, self._disk.num_slots)
        return OpStatus.IO_ERROR

    def _load_index(self) -> Dict[int, SlotEntry]:
        records = read_snapshot(self.index_path, INDEX_KIND, self._identity) or []
        entries: Dict[int, SlotEntry] = {}
        for record in records:
            if not _is_index_record(record, self._disk.num_slots):
                logger.warning("%s: record %r is not [slot, tag, checksum] with 0 <= slot < %d; "
                               "ignored", self.index_path, record, self._disk.num_slots)
                continue
            slot, tag, checksum = record
            entries[slot] = SlotEntry(tag, checksum)
        return entries


def _is_index_record(record: object, num_slots: int) -> bool:
    return (isinstance(record, list) and len(record) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in record)
            and 0 <= record[0] < num_slots)
