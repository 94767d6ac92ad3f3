"""The transfers between KV tiers that rank 0 asks of every rank, and what came of them.

Rank 0 decides every transfer; each rank carries it out on its own shard of the same blocks. Ops
travel in the step plan, in issue order, and every rank executes them first in, first out, so two
ops on the same slot never race: a read of a host slot queued before a write into it always sees
the old bytes. Op ``i`` of the whole run has ticket ``i``; tickets are implicit (the count of ops
issued before it), so every rank numbers them the same way.

Each op names the prefix hash of the block it moves (``tag``): a rank stores it next to the
block's checksum and refuses bytes whose tag or checksum does not match when they come back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Tuple, Union

from kv.types import BlockId


class OpStatus(enum.IntEnum):
    """Outcome of one op; ranks agree on the worst (highest) outcome across them."""

    OK = 0
    CHECKSUM = 1  # the bytes (or their tag) did not match what was written
    IO_ERROR = 2  # the disk refused a read or a write


@dataclass(frozen=True)
class Spill:
    """Device block -> host slot; the rank records the checksum of the bytes it wrote."""

    device_block: BlockId
    host_slot: int
    tag: int


@dataclass(frozen=True)
class Restore:
    """Host slot -> device block, after verifying the host bytes against ``tag``'s checksum."""

    host_slot: int
    device_block: BlockId
    tag: int


@dataclass(frozen=True)
class WriteDisk:
    """Host slot -> disk slot; the host slot's checksum travels with the bytes."""

    host_slot: int
    disk_slot: int
    tag: int


@dataclass(frozen=True)
class ReadDisk:
    """Disk slot -> host slot, verified against the disk slot's checksum for ``tag``."""

    disk_slot: int
    host_slot: int
    tag: int


@dataclass(frozen=True)
class SaveIndex:
    """Write this rank's disk index (slot -> tag, checksum) once every earlier op is done."""


TierOp = Union[Spill, Restore, WriteDisk, ReadDisk, SaveIndex]


@dataclass(frozen=True)
class TierOpResults:
    """The agreed outcome of tickets ``[first_ticket, first_ticket + len(statuses))``."""

    first_ticket: int
    statuses: Tuple[OpStatus, ...]

    @property
    def end_ticket(self) -> int:
        return self.first_ticket + len(self.statuses)
