"""What `kv.tiers.hierarchy.KVTiers` hands out and keeps: a block found below the device (`LowerHit`), a
request's restores (`RestoreChain`), the record of each op until its outcome is committed
(``TierRecord``), and the counters (`TierStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

from kv.prefix_hash import BlockHash
from kv.tiers.ops import OpStatus
from kv.types import BlockId


@dataclass(frozen=True)
class LowerHit:
    """A block found below the device: its hash, tokens and the tier that holds it."""

    block_hash: BlockHash
    token_ids: Tuple[int, ...]
    tier: str  # "host" or "disk"


@dataclass
class RestoreChain:
    """Blocks restored for one request, in prefix order; done when every ticket has committed."""

    hashes: List[Optional[BlockHash]]  # None for a swapped-out partial block
    last_ticket: int
    statuses: List[OpStatus] = field(init=False)  # worst agreed outcome per block

    def __post_init__(self) -> None:
        self.statuses = [OpStatus.OK] * len(self.hashes)

    def is_done(self, num_committed: int) -> bool:
        return self.last_ticket < num_committed

    @property
    def num_ok(self) -> int:
        """Leading blocks restored intact: the request may attend to these and no more."""
        for index, status in enumerate(self.statuses):
            if status != OpStatus.OK:
                return index
        return len(self.statuses)


@dataclass(frozen=True)
class SpillDone:
    """An issued spill: the device block it reads and the host slot it writes."""

    block_hash: Optional[BlockHash]  # None: a private swap-out
    host_slot: int
    device_block: BlockId


@dataclass(frozen=True)
class DiskWriteDone:
    block_hash: BlockHash
    disk_slot: int


@dataclass(frozen=True)
class ChainStep:
    chain: RestoreChain
    index: int
    host_slot: int


TierRecord = Union[SpillDone, DiskWriteDone, ChainStep, None]


@dataclass
class TierStats:
    num_spilled_blocks: int = 0  # device -> host
    num_restored_blocks: int = 0  # host -> device
    num_disk_written_blocks: int = 0
    num_disk_read_blocks: int = 0
    num_checksum_failures: int = 0
    num_io_errors: int = 0
    num_swapped_out: int = 0  # preempted requests' partial blocks kept on host
    num_swapped_in: int = 0  # of which copied back when their request resumed
    num_spills_skipped: int = 0  # write-throughs dropped: every host slot was private
    num_written_back: int = 0  # device blocks spilled when evicted (write-back)
