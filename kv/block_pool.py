"""A fixed pool of KV blocks with O(1) allocate, free and prefix-cache hit.

Free blocks sit in an intrusive doubly linked list (``prev``/``next`` on the block itself, with a
sentinel head and tail), ordered from least to most recently freed. Allocation takes from the head;
freeing appends to the tail. A freed block keeps its contents and its hash until it is allocated
again, so a later request with the same prefix finds it by hash and takes it back out of the middle
of the list in O(1)::

    head <-> [b7: cached, LRU] <-> [b2] <-> ... <-> [b4: just freed] <-> tail
              ^ allocate() evicts from here            free() appends here ^

Invariants (checked by the property tests): a block is either on the free list (``ref_count == 0``)
or in use (``ref_count > 0``), never both; ref counts never go negative; a hash maps to at most one
block and that block's stored tokens are the ones the hash was made of.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import itertools
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from kv.prefix_hash import BlockHash
from kv.types import BlockId


@dataclass(eq=False)
class Block:
    """One block of ``block_size`` KV slots. ``prev``/``next`` link it into the free list."""

    block_id: BlockId
    ref_count: int = 0
    block_hash: Optional[BlockHash] = None
    token_ids: Tuple[int, ...] = ()
    prev: Optional["Block"] = field(default=None, repr=False)
    next: Optional["Block"] = field(default=None, repr=False)

    @property
    def is_free(self) -> bool:
        return self.prev is not None


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks; every operation is O(1) and allocates nothing."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(BlockId(-1))
        self._tail = Block(BlockId(-1))
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        assert block.prev is None and block.next is None, f"block {block.block_id} already queued"
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} is not queued"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> Block:
        first = self._head.next
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """Blocks, their free list and the prefix cache (hash -> block) of one KV pool.

    Costs: ``allocate``, ``free``, ``touch`` and ``lookup`` are O(1) per block.
    """

    def __init__(self, num_blocks: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.blocks: List[Block] = [Block(BlockId(i)) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_prefix_cache = enable_prefix_cache
        self._cached: Dict[BlockHash, Block] = {}
        self.num_evicted = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> List[Block]:
        """Take ``num_blocks`` least recently freed blocks, evicting their cached contents."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free} free")
        taken = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; blocks that reach zero join the free list's tail.

        Callers pass a request's blocks in reverse order so that its last (least shareable)
        blocks are evicted before its first ones.
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Optional[Block]:
        """The cached block with this hash whose tokens are ``token_ids``, or None."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, block: Block) -> None:
        """Take a reference on a cached block found by ``lookup`` (removing it from the free list)."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def cache(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Record that the in-use ``block`` holds the full block ``token_ids`` under ``block_hash``."""
        if not self.enable_prefix_cache or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # Another block holds the same prefix; this one stays private and unhashed.
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def cached_hashes(self, limit: int) -> List[BlockHash]:
        """Up to ``limit`` hashes in the prefix cache, most recently cached first. O(limit)."""
        return list(itertools.islice(reversed(self._cached), limit))

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        self.num_evicted += 1
