"""The copier's host-hashing path on CPU: round trips over several threads with results in input
order, a failing block failing alone, and corrupted host bytes refused (the device-hashing path
and the transfer engine around it are tested in test_transfer.py)."""

import threading

import torch

from kv.tiers.block_copier import BlockCopier
from kv.integrity.checksum import block_checksum
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache, KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8,
                   dtype=torch.float32)


def make_copier(num_threads: int = 3):
    kv = KVCache(SPEC, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(0)))
    host = HostBuffer(SPEC.num_blocks, SPEC.bytes_per_block, pin=False)
    return kv, host, BlockCopier(kv, host, num_threads)


def test_round_trip_on_several_threads_keeps_input_order():
    kv, host, copier = make_copier()
    try:
        original = kv.data.clone()
        pairs = [(block, SPEC.num_blocks - 1 - block) for block in range(SPEC.num_blocks)]
        sums = copier.copy_out(pairs, lambda: None)
        assert sums == [block_checksum(host.slot(slot).numpy()) for _, slot in pairs]
        kv.data.zero_()
        written = copier.copy_in([(slot, block, s) for (block, slot), s in zip(pairs, sums)])
        assert written == [True] * SPEC.num_blocks
        assert torch.equal(kv.data, original)
    finally:
        copier.close()
        host.close()


def test_a_failing_block_fails_alone_and_corrupt_bytes_are_refused():
    kv, host, copier = make_copier()
    try:
        sums = copier.copy_out([(0, 0), (SPEC.num_blocks, 1), (2, 2)], lambda: None)
        assert sums[1] is None and None not in (sums[0], sums[2])
        host.slot(2)[5] ^= 0xFF
        before = kv.data.clone()
        assert copier.copy_in([(0, 3, sums[0]), (2, 4, sums[2]), (0, 5, None)]) == [
            True, False, False]
        assert torch.equal(kv.data[:, :, 12:16], before[:, :, 0:4])  # block 3 = block 0
        assert torch.equal(kv.data[:, :, 20:24], before[:, :, 20:24])  # no checksum, no copy
    finally:
        copier.close()
        host.close()


def test_threads_take_the_next_item_instead_of_a_fixed_share():
    """While one thread is held up on an item, the other threads finish every other item (with
    fixed shares, the items of the held thread's share would wait for it)."""
    _, host, copier = make_copier(num_threads=2)
    others_done = threading.Event()
    done = []
    lock = threading.Lock()

    def work(item: int) -> object:
        if item == 0:
            return others_done.wait(timeout=10)
        with lock:
            done.append(item)
            if len(done) == 7:
                others_done.set()
        return item

    try:
        assert copier._parallel(work, list(range(8))) == [True, *range(1, 8)]
    finally:
        copier.close()
        host.close()
