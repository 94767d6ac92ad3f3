"""The staged (batched) copy path on CPU tensors: the chunk and run planning on plain inputs, and
round trips through ``BlockCopier(staged=True)`` (the path CUDA pools take) against block-by-block
copies, with batches larger than the staging buffer, repeated slots and blocks, both checksum
strategies, and corrupted host bytes refused."""

from typing import List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv.integrity.block_checksum import ReferenceBlockHasher, mix64_strategy
from kv.integrity.checksum import block_checksum
from kv.kv_cache import KVCache, KVCacheSpec
from kv.tiers.block_copier import BlockCopier
from kv.tiers.block_staging import SlotRun, plan_chunks, slot_runs
from kv.tiers.host_buffer import HostBuffer

NUM_BLOCKS = 12
NUM_SLOTS = 10


def spec(head_dim: int) -> KVCacheSpec:
    """head_dim 32: 4096-byte blocks that fill a host slot; 8: 1 KiB blocks in 4 KiB slots."""
    return KVCacheSpec(num_layers=2, num_blocks=NUM_BLOCKS, block_size=4, num_kv_heads=2,
                       head_dim=head_dim, dtype=torch.float32)


def make(head_dim: int = 32, staging_blocks: int = 4, device_hash: bool = False):
    kv = KVCache(spec(head_dim), torch.device("cpu"), with_scratch_block=True)
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(head_dim)))
    host = HostBuffer(NUM_SLOTS, kv.spec.bytes_per_block, pin=False)
    checksum = mix64_strategy(ReferenceBlockHasher(kv)) if device_hash else None
    copier = BlockCopier(kv, host, num_threads=2, checksum=checksum, staged=True,
                         staging_bytes=staging_blocks * kv.spec.bytes_per_block)
    return kv, host, copier


def block_bytes(kv: KVCache, block: int) -> bytes:
    bs = kv.spec.block_size
    return kv.data[:, :, block * bs:(block + 1) * bs].contiguous().view(torch.uint8).numpy(
        ).tobytes()


# ----- planning, on plain inputs -----

def test_slot_runs_join_consecutive_slots_only_when_allowed():
    assert slot_runs([3, 4, 5, 7, 8], can_join=True) == [SlotRun(0, 3, 3), SlotRun(3, 7, 2)]
    assert slot_runs([3, 4], can_join=False) == [SlotRun(0, 3, 1), SlotRun(1, 4, 1)]
    assert slot_runs([3, 3, 4], can_join=True) == [SlotRun(0, 3, 1), SlotRun(1, 3, 2)]
    assert slot_runs([5, 4], can_join=True) == [SlotRun(0, 5, 1), SlotRun(1, 4, 1)]
    assert slot_runs([], can_join=True) == []


def test_plan_chunks_sorts_by_slot_and_cuts_at_capacity_and_repeats():
    assert plan_chunks([5, 1, 3], [5, 1, 3], capacity=2) == [[1, 2], [0]]
    # Destination 7 repeats at index 2: items 0-1 go first, whatever their slots.
    assert plan_chunks([9, 8, 1], [7, 6, 7], capacity=4) == [[1, 0], [2]]
    assert plan_chunks([], [], capacity=1) == []
    with pytest.raises(ValueError, match="capacity=0"):
        plan_chunks([1], [1], capacity=0)
    with pytest.raises(ValueError, match="2 slots for 1 destinations"):
        plan_chunks([1, 2], [1], capacity=1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=30),
       st.integers(1, 8))
def test_plan_chunks_covers_every_item_once_in_an_order_that_keeps_the_last_write(items,
                                                                                 capacity):
    slots = [slot for slot, _ in items]
    destinations = [destination for _, destination in items]
    chunks = plan_chunks(slots, destinations, capacity)
    order = [index for chunk in chunks for index in chunk]
    assert sorted(order) == list(range(len(items)))
    for chunk in chunks:
        assert 1 <= len(chunk) <= capacity
        assert len({destinations[i] for i in chunk}) == len(chunk)
        assert [slots[i] for i in chunk] == sorted(slots[i] for i in chunk)
    # Copying in this order leaves each destination with the last item that named it.
    final = {destinations[i]: i for i in order}
    assert final == {destination: i for i, destination in enumerate(destinations)}


# ----- round trips through the staged copier -----

@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_SLOTS - 1)),
                min_size=1, max_size=16),
       st.sampled_from([32, 8]), st.integers(1, 5), st.booleans(), st.randoms())
def test_staged_spill_then_restore_equals_block_by_block_copies(pairs, head_dim, staging_blocks,
                                                                device_hash, rng):
    kv, host, copier = make(head_dim, staging_blocks, device_hash)
    try:
        sums = copier.copy_out(pairs, lambda: None)
        expected = {slot: block_bytes(kv, block) for block, slot in pairs}  # the last one wins
        for slot, data in expected.items():
            assert host.slot(slot).numpy().tobytes() == data
        assert None not in sums
        last = {slot: i for i, (_, slot) in enumerate(pairs)}
        for slot, i in last.items():  # a slot's last checksum is its bytes' checksum
            assert sums[i] == copier.checksum.host(host.slot(slot).numpy())
        slots = sorted(expected)
        targets = rng.sample(range(NUM_BLOCKS), len(slots))
        written = copier.copy_in([(slot, block, sums[last[slot]])
                                  for slot, block in zip(slots, targets)])
        assert written == [True] * len(slots)
        for slot, block in zip(slots, targets):
            assert block_bytes(kv, block) == expected[slot]
    finally:
        copier.close()
        host.close()


@pytest.mark.parametrize("head_dim", [32, 8])
def test_kernels_and_copies_per_batch(head_dim):
    """One gather per chunk; one copy per run of consecutive slots when blocks fill their slots,
    one per block otherwise."""
    kv, host, copier = make(head_dim, staging_blocks=4)
    staging = copier.staging
    try:
        copier.copy_out([(b, b) for b in range(7)], lambda: None)  # chunks of 4 and 3
        assert staging.num_kernels == 2
        assert staging.num_copies == (2 if head_dim == 32 else 7)
        copier.copy_in([(slot, slot + 5, block_checksum(host.slot(slot).numpy()))
                        for slot in (6, 0, 2, 1)])  # runs 0-2 and 6
        assert staging.num_kernels == 3
        assert staging.num_copies == (4 if head_dim == 32 else 11)
        assert staging.nbytes == 4 * kv.spec.bytes_per_block
    finally:
        copier.close()
        host.close()


@pytest.mark.parametrize("device_hash", [False, True])
def test_staged_restore_refuses_corrupt_bytes_and_out_of_range_items_fail_alone(device_hash):
    kv, host, copier = make(device_hash=device_hash)
    try:
        sums = copier.copy_out([(0, 0), (NUM_BLOCKS, 1), (2, 2), (3, NUM_SLOTS)], lambda: None)
        assert sums[1] is None and sums[3] is None and None not in (sums[0], sums[2])
        host.slot(2)[5] ^= 0xFF
        before = block_bytes(kv, 4)
        items: List[Tuple[int, int, object]] = [(0, 3, sums[0]), (2, 4, sums[2]),
                                                (0, 5, None), (0, NUM_BLOCKS, sums[0])]
        assert copier.copy_in(items) == [True, False, False, None]
        assert block_bytes(kv, 3) == block_bytes(kv, 0)
        if not device_hash:  # host hashing checks before it copies
            assert block_bytes(kv, 4) == before
    finally:
        copier.close()
        host.close()


def test_staged_false_is_the_numpy_path_and_staged_none_is_numpy_on_cpu():
    kv = KVCache(spec(8), torch.device("cpu"))
    host = HostBuffer(NUM_SLOTS, kv.spec.bytes_per_block, pin=False)
    for staged in (None, False):
        copier = BlockCopier(kv, host, staged=staged)
        assert copier.staging is None
        copier.close()
    host.close()
