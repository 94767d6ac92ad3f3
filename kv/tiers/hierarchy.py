"""Rank 0's KV hierarchy below the device pool: what to spill, restore and evict, and when it is safe.

::

    device pool --Spill--> host tier --WriteDisk--> disk tier
         ^                  |    ^                    |
         +----Restore-------+    +------ReadDisk------+

- When a block goes down is the write policy's choice (``kv/tiers/write_policy.py``): on release
  (write-through: every full, hashed block its last request lets go of; selective: only blocks hit
  ``write_threshold`` times), issued through a ``SpillPacer``: at once without a bandwidth
  bound, else as the bound allows (at release and at each ``take_ops``; a queued block the pool
  evicts first is dropped); or on eviction (write-back: when the device pool reuses it). Hot blocks
  too: the device holds them, but still evicts them as a last resort. A spill takes no reference
  on its block: when a step's model would write a block a spill may still be reading
  (``is_being_read``), every rank first waits for the device side of its queued spills.
- The host tier makes room by evicting its policy's victim; a victim not yet on disk is written
  there first (inclusive hierarchy: a block read back from disk keeps its disk copy), unless the
  selective policy finds it hit fewer than ``write_threshold`` times.
- A prefix that misses on the device and hits below is restored: disk blocks are read into host
  slots, host blocks copied into fresh device blocks. The request waits for its
  ``RestoreChain`` (the engine runs a step's restores before its compute, so usually not past
  that step); it uses the restored blocks up to the first one whose checksum failed.
- Failures: a checksum mismatch or an I/O error drops the block (and, for a restore, the blocks
  after it in the chain) from every lower tier, is counted, and the tokens are recomputed.

Every op gets a ticket; ``commit`` applies the outcomes the ranks agreed on (``TierOpResults``).
Nothing here touches bytes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from kv.block_pool import Block, BlockPool
from kv.prefix_hash import BlockHash
from kv.tiers.index import TierEntry, TierIndex
from kv.tiers.records import (ChainStep, DiskWriteDone, LowerHit, RestoreChain, SpillDone,
                             TierRecord, TierStats)
from kv.tiers.ops import (OpStatus, ReadDisk, Restore, SaveIndex, Spill, TierOp, TierOpResults,
                         WriteDisk)
from kv.types import BlockId
from kv.tiers.write_policy import HitCounter, SpillPacer, check_write_policy


class KVTiers:
    """Host (and optionally disk) tiers under one device ``BlockPool``; rank 0 only."""

    def __init__(self, pool: BlockPool, block_size: int, host: TierIndex,
                 disk: Optional[TierIndex] = None, write_policy: str = "write_through",
                 write_threshold: int = 1, spill_gbps: Optional[float] = None,
                 block_bytes: int = 1) -> None:
        """``block_bytes``: one block's bytes on one rank (what ``spill_gbps`` is paid in)."""
        check_write_policy(write_policy, write_threshold, spill_gbps)
        self.pool = pool
        self.block_size = block_size
        self.host = host
        self.disk = disk
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        num_known = pool.num_blocks + host.num_slots + (disk.num_slots if disk else 0)
        self.hits = HitCounter(2 * num_known)
        self.pacer = SpillPacer(block_bytes, spill_gbps, max_pending=pool.num_blocks)
        pool.on_evict = self._on_device_evict
        self.stats = TierStats()
        self._ops: List[TierOp] = []
        self._records: Dict[int, TierRecord] = {}
        self._spilling: Dict[BlockId, int] = {}  # device block -> ticket of its last spill
        self.num_issued = 0  # tickets handed out so far
        self.num_committed = 0

    # ----- lookups -----

    def find_lower(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                   start: int, end: int) -> List[LowerHit]:
        """Blocks ``start..end-1`` of a prefix found on host or disk, stopping at the first miss."""
        hits: List[LowerHit] = []
        bs = self.block_size
        for index in range(start, end):
            tokens = tuple(token_ids[index * bs:(index + 1) * bs])
            block_hash = block_hashes[index]
            if self.host.lookup(block_hash, tokens) is not None:
                hits.append(LowerHit(block_hash, tokens, "host"))
            elif self.disk is not None and self.disk.lookup(block_hash, tokens) is not None:
                hits.append(LowerHit(block_hash, tokens, "disk"))
            else:
                break
        return hits

    def count_lookup(self, num_queried: int, hits: Sequence[LowerHit]) -> None:
        """Count an admitted request's lookup below the device (blocks)."""
        num_host = sum(1 for hit in hits if hit.tier == "host")
        self.host.num_queries += num_queried
        self.host.num_hits += num_host
        if self.disk is not None:
            self.disk.num_queries += num_queried - num_host
            self.disk.num_hits += len(hits) - num_host

    def record_hits(self, block_hashes: Sequence[BlockHash]) -> None:
        """Blocks a request found cached, in any tier (the selective policy counts them)."""
        for block_hash in block_hashes:
            self.hits.hit(block_hash)

    def record_access(self, block_hash: BlockHash) -> None:
        self.host.policy.record_access(block_hash)
        if self.disk is not None:
            self.disk.policy.record_access(block_hash)

    def usage(self) -> Dict[str, int]:
        """Blocks used/total and lookups/hits per lower tier, and the failure counts."""
        out = {
            "host_blocks_used": self.host.num_used, "host_blocks_total": self.host.num_slots,
            "host_queries_total": self.host.num_queries, "host_hits_total": self.host.num_hits,
            "checksum_failures_total": self.stats.num_checksum_failures,
            "io_errors_total": self.stats.num_io_errors,
            "swapped_out_total": self.stats.num_swapped_out,
            "swapped_in_total": self.stats.num_swapped_in,
            "spills_skipped_total": self.stats.num_spills_skipped,
            "spills_dropped_total": self.pacer.num_dropped,
            "spills_pending": self.pacer.num_pending,
            "written_back_total": self.stats.num_written_back,
        }
        if self.disk is not None:
            out.update({
                "disk_blocks_used": self.disk.num_used, "disk_blocks_total": self.disk.num_slots,
                "disk_queries_total": self.disk.num_queries, "disk_hits_total": self.disk.num_hits,
            })
        return out

    # ----- issuing ops -----

    def on_release(self, blocks: Sequence[Block]) -> None:
        """Blocks whose last request let go of them: queue the ones the write policy sends down
        now (write-back sends none; see the module docstring). O(len(blocks))."""
        if self.write_policy == "write_back":
            return
        # Hot (held) blocks are queued as well: the pool still evicts them as a last resort, and
        # copying one now, off the critical path and once per stay on host (their score keeps
        # them there), is cheaper than copying it when it is evicted, which would make the step
        # that reuses the block wait until the copy has read it.
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None or block.ref_count != 0 or block_hash in self.host.entries:
                continue
            if self._is_selected(block_hash):
                self.pacer.offer(block.block_id, (block, block_hash))
        # Issued by the next take_ops (without a bandwidth bound: all of them), so behind the
        # restores the next step's admissions queue: a step that waits for its restores does
        # not wait for these copies too. A block the pool reuses before then is spilled as it
        # is reused (``_on_device_evict``).

    def _on_device_evict(self, block: Block) -> None:
        """The pool is about to reuse cached ``block``: a queued spill of it is issued now,
        ahead of the reuse, when no bandwidth bound paces the spills, and dropped otherwise (it
        would no longer hold those bytes by the time its turn comes); write-back spills it now."""
        block_hash = block.block_hash
        if not self.pacer.is_bounded:
            queued = self.pacer.pop(block.block_id)
            if (queued is not None and self._is_still_cached(queued)
                    and block_hash not in self.host.entries):
                self._spill(block, block_hash)  # type: ignore[arg-type]
        else:
            self.pacer.discard(block.block_id)
        if (self.write_policy == "write_back" and block_hash is not None
                and block_hash not in self.host.entries):
            if self._spill(block, block_hash):
                self.stats.num_written_back += 1

    def _issue_paced(self) -> None:
        for block, block_hash in self.pacer.take(self._is_still_cached):
            if block_hash not in self.host.entries:
                self._spill(block, block_hash)

    def _spill(self, block: Block, block_hash: BlockHash) -> bool:
        """Copy a cached device block to a fresh host slot. Never raises for lack of room: while
        preempted requests' tails hold every host slot privately, the block is skipped
        (``num_spills_skipped``) and stays on the device only, as it would without a host tier."""
        if not self.host.can_take():
            self.stats.num_spills_skipped += 1
            return False
        slot = self._take_host_slot()
        self.host.insert(block_hash, block.token_ids, slot)
        self._issue_spill(Spill(block.block_id, slot, block_hash), block_hash)
        self.stats.num_spilled_blocks += 1
        return True

    @staticmethod
    def _is_still_cached(item: object) -> bool:
        block, block_hash = item  # type: ignore[misc]
        return block.block_hash == block_hash

    def _is_selected(self, block_hash: BlockHash) -> bool:
        return (self.write_policy != "write_through_selective"
                or self.hits[block_hash] >= self.write_threshold)

    def can_swap_out(self) -> bool:
        return self.host.can_take()

    def swap_out(self, block: Block, tag: int) -> int:
        """Copy a private (partly filled) device block to a private host slot; returns the slot."""
        slot, evicted = self.host.take_private()
        self._write_back(evicted)
        self._issue_spill(Spill(block.block_id, slot, tag), None)
        self.stats.num_swapped_out += 1
        return slot

    def release_private(self, slot: int) -> None:
        self.host.release_private(slot)

    def hold(self, hits: Sequence[LowerHit]) -> None:
        """Keep ``hits`` in their tiers until ``restore`` has queued their reads: allocating the
        request's device blocks may evict device blocks, and write-back spills those into host
        slots, which would otherwise evict a host (and then disk) block the request found."""
        for hit in hits:
            self._tier_of(hit).hold(hit.block_hash)

    def _tier_of(self, hit: LowerHit) -> TierIndex:
        tier = self.host if hit.tier == "host" else self.disk
        assert tier is not None
        return tier

    def restore(self, hits: Sequence[LowerHit], device_blocks: Sequence[Block],
                swapped: Optional[Tuple[int, int, Block]] = None) -> RestoreChain:
        """Queue the copies that fill ``device_blocks`` with ``hits`` (and a swapped-out partial
        block: (host slot, tag, device block)); the request waits for the returned chain.

        Host hits are queued first: reading a disk hit takes a host slot, which may evict one of
        them, and an eviction queued behind their copies is harmless (first in, first out)."""
        hashes: List[Optional[BlockHash]] = [hit.block_hash for hit in hits]
        if swapped is not None:
            hashes.append(None)
        chain = RestoreChain(hashes, last_ticket=-1)
        # Disk slots are read before any eviction below can give one of them to another block
        # (if it does, the read finds the other block's tag and fails its checksum: safe).
        disk_slots = {hit.block_hash: self.disk.entries[hit.block_hash].slot
                      for hit in hits if hit.tier == "disk" and self.disk is not None}
        order = sorted(range(len(hits)), key=lambda i: hits[i].tier != "host")
        for index in order:
            hit, block = hits[index], device_blocks[index]
            slot = self._host_slot_for(hit, disk_slots.get(hit.block_hash), chain, index)
            self.host.policy.record_access(hit.block_hash)
            self._issue(Restore(slot, block.block_id, hit.block_hash),
                        ChainStep(chain, index, slot))
            self.stats.num_restored_blocks += 1
        if swapped is not None:
            slot, tag, block = swapped
            self._issue(Restore(slot, block.block_id, tag), ChainStep(chain, len(hits), slot))
            self.stats.num_swapped_in += 1
        chain.last_ticket = self.num_issued - 1
        for hit in hits:  # see ``hold``
            self._tier_of(hit).unhold(hit.block_hash)
        return chain

    def is_being_read(self, block_id: BlockId) -> bool:
        """Whether a spill of this device block may still be reading it (not yet committed)."""
        return block_id in self._spilling

    @property
    def has_spills_in_flight(self) -> bool:
        return bool(self._spilling)

    def save_index(self) -> None:
        """Ask every rank to snapshot its disk checksums once the writes before it are done."""
        self._issue(SaveIndex(), None)

    def take_ops(self) -> Tuple[TierOp, ...]:
        """The ops issued since the last call, the paced spills the bandwidth allows now first."""
        self._issue_paced()
        ops, self._ops = tuple(self._ops), []
        return ops

    @property
    def has_outstanding(self) -> bool:
        """Ops issued and not yet committed, or spills still waiting for their bandwidth."""
        return self.num_issued > self.num_committed or self.pacer.num_pending > 0

    def paced_wait_s(self) -> float:
        """How long a step would find nothing to do but wait for the spill bound: 0 while ops
        are in flight (steps commit them), else until the bucket pays for the next spill."""
        if self.num_issued > self.num_committed:
            return 0.0
        return self.pacer.wait_s()

    # ----- committing -----

    def commit(self, results: TierOpResults) -> None:
        """Apply the ranks' agreed outcomes of tickets ``results.first_ticket..end_ticket-1``."""
        assert results.first_ticket == self.num_committed, "tickets committed out of order"
        finished_chains: List[RestoreChain] = []
        for offset, status in enumerate(results.statuses):
            record = self._records.pop(results.first_ticket + offset)
            # A block read from disk that fails there fails its copy to the device as well:
            # count it once.
            if not (isinstance(record, ChainStep)
                    and record.chain.statuses[record.index] != OpStatus.OK):
                self._count_failure(status)
            if isinstance(record, SpillDone):
                self._commit_spill(record, results.first_ticket + offset, status)
            elif isinstance(record, DiskWriteDone):
                if status != OpStatus.OK and self.disk is not None:
                    self.disk.discard_slot(record.block_hash, record.disk_slot)
            elif isinstance(record, ChainStep):
                self._commit_chain_step(record, status)
                if record.chain.last_ticket == results.first_ticket + offset:
                    finished_chains.append(record.chain)
        self.num_committed = results.end_ticket
        for chain in finished_chains:
            self._drop_after_failure(chain)

    def _count_failure(self, status: OpStatus) -> None:
        if status == OpStatus.CHECKSUM:
            self.stats.num_checksum_failures += 1
        elif status == OpStatus.IO_ERROR:
            self.stats.num_io_errors += 1

    def _commit_spill(self, record: SpillDone, ticket: int, status: OpStatus) -> None:
        if self._spilling.get(record.device_block) == ticket:
            del self._spilling[record.device_block]
        if status != OpStatus.OK and record.block_hash is not None:
            self.host.discard_slot(record.block_hash, record.host_slot)

    def _commit_chain_step(self, record: ChainStep, status: OpStatus) -> None:
        chain = record.chain
        chain.statuses[record.index] = max(chain.statuses[record.index], status)
        block_hash = chain.hashes[record.index]
        if status != OpStatus.OK and block_hash is not None:
            self.host.discard_slot(block_hash, record.host_slot)

    def _drop_after_failure(self, chain: RestoreChain) -> None:
        """The failed block and its descendants in the chain leave every lower tier."""
        for block_hash in chain.hashes[chain.num_ok:]:
            if block_hash is None:
                continue
            if block_hash in self.host.entries:
                self.host.remove(block_hash)
            if self.disk is not None and block_hash in self.disk.entries:
                self.disk.remove(block_hash)

    # ----- helpers -----

    def _issue(self, op: TierOp, record: TierRecord) -> None:
        self._ops.append(op)
        self._records[self.num_issued] = record
        self.num_issued += 1

    def _issue_spill(self, op: Spill, block_hash: Optional[BlockHash]) -> None:
        self._spilling[op.device_block] = self.num_issued
        self._issue(op, SpillDone(block_hash, op.host_slot, op.device_block))

    def _take_host_slot(self) -> int:
        slot, evicted = self.host.take_slot()
        self._write_back(evicted)
        return slot

    def _write_back(self, evicted: Optional[Tuple[BlockHash, TierEntry]]) -> None:
        """A block evicted from the host goes to disk unless it is there already."""
        if evicted is None or self.disk is None:
            return
        block_hash, entry = evicted
        if block_hash in self.disk.entries:
            self.disk.policy.record_access(block_hash)
            return
        if not self._is_selected(block_hash):
            return
        disk_slot, _ = self.disk.take_slot()
        self.disk.insert(block_hash, entry.token_ids, disk_slot)
        self._issue(WriteDisk(entry.slot, disk_slot, block_hash),
                    DiskWriteDone(block_hash, disk_slot))
        self.stats.num_disk_written_blocks += 1

    def _host_slot_for(self, hit: LowerHit, disk_slot: Optional[int], chain: RestoreChain,
                       index: int) -> int:
        """The host slot holding ``hit``, reading it from disk into a host slot first if needed."""
        if hit.tier == "host":
            return self.host.entries[hit.block_hash].slot
        assert self.disk is not None and disk_slot is not None
        self.disk.policy.record_access(hit.block_hash)
        slot = self._take_host_slot()
        if hit.block_hash in self.host.entries:  # read back earlier in this chain? never twice
            self.host.remove(hit.block_hash)
        self.host.insert(hit.block_hash, hit.token_ids, slot)
        self._issue(ReadDisk(disk_slot, slot, hit.block_hash),
                    ChainStep(chain, index, slot))
        self.stats.num_disk_read_blocks += 1
        return slot
