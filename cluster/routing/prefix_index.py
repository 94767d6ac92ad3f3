"""Which groups hold which prompt blocks: one index for the router, so that the length of a
request's cached prefix on every group costs one lookup per request block, not one per block per
group.

    index = PrefixIndex()
    bit = index.add_group("g1")            # a bit of its own
    index.add(bit, hashes); index.discard(bit, hashes)
    index.prefix_blocks(request_hashes)    # {"g1": 12, ...}: the groups holding a prefix
    index.prefix_split(request_hashes, bits)  # (8, {"g1": 12}): what all hold, who holds more

Block hashes are chained (`kv.prefix_hash`): a block's hash names its whole prefix, so a group's
cached prefix is the leading run of request hashes it holds. The index maps each hash to the
bitmask of the groups holding it; a request's hashes are walked once, ANDing the masks, and a
group's prefix ends where its bit drops out.

Why: scanning each group's set for the leading run costs one set lookup per cached block per
group (with 64 groups holding an 8-block system prompt, about 600 a decision, each a cache miss
between engine steps; docs/benchmarks/router-decision.md). The walk here costs one dict lookup per request block
(fewer: it stops once no group is left).

Costs: ``add``/``discard`` O(hashes given); ``prefix_blocks`` O(request blocks + groups with a
prefix). Not thread-safe: the router calls it from its event loop only.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from kv.prefix_hash import BlockHash

logger = logging.getLogger(__name__)


class PrefixIndex:
    """Block hash -> bitmask of the groups holding it (see the module doc)."""

    def __init__(self, native: Optional[ModuleType] = None) -> None:
        """``native``: `cluster.routing.native_rank.load()`'s module, to keep a C mirror (``table``)."""
        self._native = native
        self._table = native.new_table() if native is not None else None
        self._masks: Dict[BlockHash, int] = {}
        self._group_of_bit: Dict[int, str] = {}
        self._bit_of_group: Dict[str, int] = {}
        self._free_bits: List[int] = []
        self._next_bit = 1

    def __len__(self) -> int:
        """Distinct hashes held by any group."""
        return len(self._masks)

    @property
    def table(self) -> Any:
        """The mirror of the index for `cluster.routing.native_rank`'s walk (None: there is none, or a
        hash could not be mirrored)."""
        return self._table

    def add_group(self, group_id: str) -> int:
        """The bit of ``group_id`` (a new one, or a freed one reused, for a new group)."""
        bit = self._bit_of_group.get(group_id)
        if bit is not None:
            return bit
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        self._bit_of_group[group_id] = bit
        self._group_of_bit[bit] = group_id
        return bit

    def remove_group(self, group_id: str, held: Iterable[BlockHash]) -> None:
        """Forget ``group_id``: ``held`` must be every hash it was given and not discarded."""
        bit = self._bit_of_group.pop(group_id, None)
        if bit is None:
            return
        self.discard(bit, held)
        del self._group_of_bit[bit]
        self._free_bits.append(bit)

    def add(self, bit: int, hashes: Iterable[BlockHash]) -> None:
        if self._table is not None:
            hashes = self._mirror(hashes, bit, True)
        masks = self._masks
        for block_hash in hashes:
            masks[block_hash] = masks.get(block_hash, 0) | bit

    def discard(self, bit: int, hashes: Iterable[BlockHash]) -> None:
        if self._table is not None:
            hashes = self._mirror(hashes, bit, False)
        masks = self._masks
        keep = ~bit
        for block_hash in hashes:
            mask = masks.get(block_hash, 0) & keep
            if mask:
                masks[block_hash] = mask
            else:
                masks.pop(block_hash, None)

    def _mirror(self, hashes: Iterable[BlockHash], bit: int, add: bool) -> Iterable[BlockHash]:
        """Apply an add or discard to the C mirror; returns ``hashes`` for the dict (a list if
        they were an iterator, which the mirror has read)."""
        if not isinstance(hashes, (list, tuple, set, frozenset, dict)):
            hashes = list(hashes)
        try:
            self._native.table_update(self._table, hashes, bit, add)
        except ValueError as e:  # the table marked itself unusable: fleets rank in Python
            logger.warning("prefix index: %s", e)
            self._table = None
        return hashes

    def prefix_blocks(self, hashes: Sequence[BlockHash]) -> Dict[str, int]:
        """For each group holding at least the first of ``hashes``: how many leading ones it
        holds. Groups holding none are left out."""
        if not hashes:
            return {}
        masks = self._masks
        alive = masks.get(hashes[0], 0)
        found: Dict[str, int] = {}
        if not alive:
            return found
        for position in range(1, len(hashes)):
            mask = alive & masks.get(hashes[position], 0)
            if mask != alive:
                _name(self._group_of_bit, alive & ~mask, position, found)
                alive = mask
                if not alive:
                    return found
        _name(self._group_of_bit, alive, len(hashes), found)
        return found

    def prefix_split(self, hashes: Sequence[BlockHash], among: int,
                     names: Optional[Mapping[int, Any]] = None) -> Tuple[int, Dict[Any, int]]:
        """For the groups whose bits are set in ``among``: the fewest leading ``hashes`` any of
        them holds (the base: 0, or say a system prompt they all hold), and each group holding
        more, with how many it holds. Only the groups that outlast the base are named, so a walk
        costs O(request blocks + those groups), however many groups share the base. A group is
        named by its id, or by ``names[its bit]`` (the router names them by their index in its
        loads)."""
        names = self._group_of_bit if names is None else names
        found: Dict[Any, int] = {}
        if not hashes or not among:
            return 0, found
        masks = self._masks
        alive = masks.get(hashes[0], 0) & among
        base = None if alive == among else 0  # None: every group still holds the prefix walked
        if not alive:
            return 0, found
        for position in range(1, len(hashes)):
            mask = alive & masks.get(hashes[position], 0)
            if mask != alive:
                if base is None:
                    base = position  # the groups dropping first hold the base
                else:
                    _name(names, alive & ~mask, position, found)
                alive = mask
                if not alive:
                    return base, found
        if base is None:
            return len(hashes), found
        _name(names, alive, len(hashes), found)
        return base, found



def _name(names: Mapping[Any, Any], bits: int, length: int, found: Dict[Any, int]) -> None:
    """``found[names[bit]] = length`` for each bit set in ``bits``."""
    while bits:
        low = bits & -bits
        found[names[low]] = length
        bits ^= low
