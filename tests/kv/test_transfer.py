"""One rank's tier copies: round trips, refused corruption, FIFO order, disk index, TP agreement,
and a failed or stuck worker failing every wait instead of hanging it.

Tests on the ``tiers`` fixture run twice: with xxh3 hashed on the host (CPU pools) and with mix64
hashed "on the device" by the kernel's numpy twin (the copier's CUDA-with-CuPy path, run on CPU:
hash before a spill's copy, copy then verify on a restore, disk reads verified on the host by
the numpy reference)."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kv.integrity.block_checksum import ReferenceBlockHasher, index_identity, mix64_strategy
from kv.tiers.disk.index import write_snapshot
from kv.tiers.disk.store import DiskStore
from kv.tiers.disk.striped import StripedDiskStore
from kv.tiers.host_buffer import HostBuffer
from kv.kv_cache import KVCache, KVCacheSpec
from kv.tiers.ops import OpStatus, ReadDisk, Restore, SaveIndex, Spill, WriteDisk
from kv.tiers.disk.transfer import INDEX_KIND
from kv.tiers.transfer import TransferEngine, split_runs
from workers.multiproc import free_tcp_init_method

OK, CHECKSUM, IO_ERROR = OpStatus.OK, OpStatus.CHECKSUM, OpStatus.IO_ERROR
# 2 layers x K/V x 4 tokens x 2 heads x 8 dims x 4 bytes = 1 KiB per block, 4 KiB slots.
SPEC = KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8,
                   dtype=torch.float32)


def random_cache(seed: int = 0) -> KVCache:
    kv = KVCache(SPEC, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def block(kv: KVCache, index: int) -> torch.Tensor:
    bs = SPEC.block_size
    return kv.data[:, :, index * bs:(index + 1) * bs]  # [L, 2, bs, H, D]


@pytest.fixture(params=["xxh3", "mix64-device", "xxh3-staged", "mix64-staged"])
def tiers(tmp_path, request):
    """(kv, host, disk, make_engine); engines and stores are closed after the test. "-staged":
    copies through the staging buffer, as on CUDA (without CuPy: xxh3; with it: mix64)."""
    kv = random_cache()
    host = HostBuffer(8, SPEC.bytes_per_block, pin=False)
    disk = DiskStore(tmp_path / "slots.bin", 16, host.slot_bytes)
    engines = []

    def make_engine(identity: str = "model-a/rank0", checksum=request.param) -> TransferEngine:
        strategy = None if checksum.startswith("xxh3") else mix64_strategy(
            ReferenceBlockHasher(kv))
        engines.append(TransferEngine(kv, host, disk, tmp_path / "index.json", identity,
                                      checksum=strategy, staged=checksum.endswith("-staged")))
        assert engines[-1].checksum.name == checksum.split("-")[0]
        return engines[-1]

    yield kv, host, disk, make_engine
    for engine in engines:
        engine.close()
    disk.close()
    host.close()


def run(engine: TransferEngine, ops) -> tuple:
    engine.submit(ops)
    results = engine.agree(None, wait=True)
    assert results.end_ticket == engine.num_committed == engine.num_submitted
    return results.statuses


def test_host_buffer_slots_are_page_aligned_and_validated():
    host = HostBuffer(3, 5000, pin=False)
    assert host.slot_bytes == 8192 and host.data.shape == (3, 8192)
    assert host.data.data_ptr() % 4096 == 0
    assert host.slot(2).shape == (5000,) and len(host.view(2)) == 8192
    with pytest.raises(IndexError, match="host slot 3"):
        host.slot(3)
    with pytest.raises(ValueError, match="num_slots=0"):
        HostBuffer(0, 5000, pin=False)


def test_split_runs_groups_one_kind_until_a_destination_repeats():
    ops = [Spill(0, 0, 1), Spill(1, 1, 2), WriteDisk(0, 0, 1), WriteDisk(1, 1, 2),
           WriteDisk(0, 1, 1), SaveIndex(), SaveIndex()]
    assert [len(run) for run in split_runs(ops)] == [2, 2, 1, 1, 1]


def test_spill_then_restore_to_other_blocks_round_trips(tiers):
    kv, host, _, make_engine = tiers
    engine = make_engine()
    originals = [block(kv, b).clone() for b in range(3)]
    assert run(engine, [Spill(b, b, tag=100 + b) for b in range(3)]) == (OK,) * 3
    kv.data.zero_()
    statuses = run(engine, [Restore(b, b + 4, tag=100 + b) for b in range(3)])
    assert statuses == (OK,) * 3
    for b, original in enumerate(originals):
        assert torch.equal(block(kv, b + 4), original)
    assert engine.num_outstanding == 0 and engine.num_done() == 6
    assert engine.num_bytes_spilled == engine.num_bytes_restored == 3 * SPEC.bytes_per_block
    assert engine.transfer_latency.count == 2


def test_agree_reports_each_ticket_once(tiers):
    _, _, _, make_engine = tiers
    engine = make_engine()
    engine.submit([Spill(0, 0, 1)])
    first = engine.agree(None, wait=True)
    engine.submit([Spill(1, 1, 2), Restore(0, 2, 1)])
    second = engine.agree(None, wait=True)
    assert (first.first_ticket, first.statuses) == (0, (OK,))
    assert (second.first_ticket, second.statuses) == (1, (OK, OK))
    assert engine.agree(None, wait=True).statuses == ()


def test_corrupt_host_bytes_or_wrong_tag_refuse_restore(tiers):
    kv, host, _, make_engine = tiers
    engine = make_engine()
    assert run(engine, [Spill(0, 0, tag=7), Spill(1, 1, tag=8)]) == (OK, OK)
    host.slot(0)[5] ^= 0xFF
    untouched = block(kv, 5).clone()
    statuses = run(engine, [Restore(0, 4, tag=7), Restore(1, 5, tag=9), Restore(1, 6, tag=8)])
    assert statuses == (CHECKSUM, CHECKSUM, OK)
    # The bad bytes were copied before the check (on CPU and when hashed on the device): block 4
    # is not attended to (its restore failed); a wrong tag is refused before any copy.
    assert torch.equal(block(kv, 5), untouched)
    assert torch.equal(block(kv, 6), block(kv, 1))


def test_disk_round_trip_coalesces_consecutive_slots(tiers):
    kv, host, disk, make_engine = tiers
    engine = make_engine()
    originals = [block(kv, b).clone() for b in range(4)]
    calls_before = disk.num_io_calls
    engine.submit([Spill(b, b, tag=b + 1) for b in range(4)]
                  + [WriteDisk(b, 10 + b, tag=b + 1) for b in range(4)])
    engine.wait_all()
    assert disk.num_io_calls - calls_before < 4  # one pwritev for slots 10..13
    host.data.fill_(0xAB)
    kv.data.zero_()
    statuses = run(engine, [ReadDisk(10 + b, 4 + b, tag=b + 1) for b in range(4)]
                   + [Restore(4 + b, b, tag=b + 1) for b in range(4)])
    assert statuses == (OK,) * 16
    for b, original in enumerate(originals):
        assert torch.equal(block(kv, b), original)
    assert engine.num_bytes_disk_written == engine.num_bytes_disk_read == 4 * host.slot_bytes


def test_striped_disk_round_trip_and_one_failing_directory(tmp_path):
    """Over three directories (units of 5 slots: a 0-4 and 15, b 5-9, c 10-14): blocks written
    across all of them come back; when b loses its file only b's slots fail."""
    kv = random_cache(3)
    host = HostBuffer(8, SPEC.bytes_per_block, pin=False)
    paths = [tmp_path / name / "blocks.bin" for name in "abc"]
    disk = StripedDiskStore(paths, 16, host.slot_bytes)
    engine = TransferEngine(kv, host, disk, tmp_path / "index.json", "model-a/rank0")
    try:
        disk_slots = [3, 4, 5, 6, 9, 10, 11, 15]
        originals = [block(kv, b).clone() for b in range(8)]
        assert run(engine, [Spill(b, b, tag=b + 1) for b in range(8)]
                   + [WriteDisk(b, disk_slots[b], tag=b + 1) for b in range(8)]) == (OK,) * 16
        assert [w for w, _ in disk.directory_bytes()] == [3 * host.slot_bytes,
                                                          3 * host.slot_bytes,
                                                          2 * host.slot_bytes]
        os.truncate(paths[1], 0)  # b's drive lost its data
        kv.data.zero_()
        statuses = run(engine, [ReadDisk(disk_slots[b], b, tag=b + 1) for b in range(8)]
                       + [Restore(b, b, tag=b + 1) for b in range(8)])
        failed = [b for b in range(8) if statuses[b] is not OK]
        assert failed == [2, 3, 4]  # disk slots 5, 6, 9: directory b
        assert all(statuses[b] is IO_ERROR for b in failed)
        for b in set(range(8)) - set(failed):
            assert torch.equal(block(kv, b), originals[b])
    finally:
        engine.close()
        disk.close()
        host.close()


def test_flipped_disk_byte_fails_read_disk(tiers):
    _, host, disk, make_engine = tiers
    engine = make_engine()
    assert run(engine, [Spill(0, 0, tag=5), WriteDisk(0, 3, tag=5), ReadDisk(3, 1, tag=5)]) == (
        OK, OK, OK)
    with open(disk.path, "r+b") as file:
        file.seek(3 * host.slot_bytes + 100)
        byte = file.read(1)[0]
        file.seek(3 * host.slot_bytes + 100)
        file.write(bytes([byte ^ 0x01]))
    statuses = run(engine, [ReadDisk(3, 1, tag=5), Restore(1, 2, tag=5), ReadDisk(3, 2, tag=6)])
    assert statuses == (CHECKSUM, CHECKSUM, CHECKSUM)


def test_ops_run_in_ticket_order_across_slot_reuse(tiers):
    kv, _, _, make_engine = tiers
    engine = make_engine()
    b0, b1 = block(kv, 0).clone(), block(kv, 1).clone()
    statuses = run(engine, [Spill(0, 0, tag=1), WriteDisk(0, 0, tag=1), Spill(1, 0, tag=2),
                            ReadDisk(0, 1, tag=1), Restore(1, 2, tag=1), Restore(0, 3, tag=2)])
    assert statuses == (OK,) * 6
    assert torch.equal(block(kv, 2), b0) and torch.equal(block(kv, 3), b1)


def test_saved_index_survives_a_restart_of_the_same_identity(tiers):
    _, _, _, make_engine = tiers
    engine = make_engine()
    big_tag = 2**64 - 1
    assert run(engine, [Spill(0, 0, tag=big_tag), Spill(1, 1, tag=3), WriteDisk(0, 4, big_tag),
                        WriteDisk(1, 5, 3), SaveIndex()]) == (OK,) * 5
    engine.close()
    restarted = make_engine()
    assert restarted.disk_tags() == {4: big_tag, 5: 3}
    assert run(restarted, [ReadDisk(4, 2, big_tag), Restore(2, 6, big_tag)]) == (OK, OK)
    assert make_engine(identity="model-b/rank0").disk_tags() == {}


def test_index_records_outside_the_disk_are_ignored(tiers, tmp_path, caplog, request):
    checksum_name = request.node.callspec.params["tiers"].split("-")[0]
    write_snapshot(tmp_path / "index.json", INDEX_KIND,
                   index_identity("model-a/rank0", checksum_name),
                   [[2, 11, 12], [16, 13, 14], ["x"]])
    _, _, _, make_engine = tiers
    assert make_engine().disk_tags() == {2: 11}
    assert "[16, 13, 14]" in caplog.text and "['x']" in caplog.text


def test_failing_op_does_not_stop_later_ops(tiers):
    kv, _, _, make_engine = tiers
    engine = make_engine()
    statuses = run(engine, [Spill(0, 0, tag=1), Restore(0, 99, tag=1), Spill(99, 1, tag=2),
                            WriteDisk(0, 99, tag=1), WriteDisk(0, 1, tag=1), Restore(0, 5, tag=1)])
    assert statuses == (OK, IO_ERROR, IO_ERROR, IO_ERROR, OK, OK)
    assert torch.equal(block(kv, 5), block(kv, 0))
    assert engine.disk_tags() == {1: 1}


def test_disk_op_without_disk_is_an_io_error():
    kv = random_cache()
    engine = TransferEngine(kv, HostBuffer(2, SPEC.bytes_per_block, pin=False))
    try:
        assert run(engine, [Spill(0, 0, 1), WriteDisk(0, 0, 1), SaveIndex()]) == (
            OK, IO_ERROR, IO_ERROR)
        with pytest.raises(TypeError, match="not a tier op"):
            engine.submit(["spill"])
    finally:
        engine.close()
        engine.close()
    with pytest.raises(RuntimeError, match="after close"):
        engine.submit([Spill(0, 0, 1)])


@pytest.mark.timeout(30)
def test_a_copier_exception_in_a_spill_fails_every_wait_instead_of_hanging(tiers, monkeypatch):
    """The copier raises before the spill has read its device blocks: the worker must not leave
    ``wait_device_reads`` waiting for a read that will never be reported."""
    _, _, _, make_engine = tiers
    engine = make_engine()

    def broken_copy_out(*args, **kwargs):
        raise RuntimeError("copier broke")

    monkeypatch.setattr(engine._copier, "copy_out", broken_copy_out)
    engine.submit([Spill(0, 0, tag=1)])
    with pytest.raises(RuntimeError, match=r"Spill .*tickets 0\.\.0.*copier broke"):
        engine.wait_device_reads()
    with pytest.raises(RuntimeError, match="copier broke"):  # failed for good
        engine.agree(None, wait=False)
    with pytest.raises(RuntimeError, match="copier broke"):
        engine.submit([Spill(1, 1, tag=2)])
    engine.close()  # returns: the worker has stopped


@pytest.mark.timeout(30)
def test_an_exception_in_the_worker_loop_fails_the_next_wait(tiers, monkeypatch):
    """Not an op but the loop around them raises: the thread ends, and the wait for the next
    batch, which nobody will run, raises instead of blocking forever."""
    _, _, _, make_engine = tiers
    engine = make_engine()

    def broken_record(seconds):
        raise RuntimeError("latency recorder broke")

    monkeypatch.setattr(engine.transfer_latency, "record", broken_record)
    engine.submit([Spill(0, 0, tag=1)])
    with pytest.raises(RuntimeError, match="latency recorder broke"):
        # The worker may have failed already, and then this submit raises instead of the wait.
        engine.submit([Spill(1, 1, tag=2)])
        engine.wait_all()


@pytest.mark.timeout(30)
def test_a_disk_store_closed_under_the_engine_fails_it(tiers):
    """Not an I/O error (those fail their blocks only) but a broken rank: the engine fails, so
    the group is replaced instead of quietly losing every later disk op."""
    _, _, disk, make_engine = tiers
    engine = make_engine()
    assert run(engine, [Spill(0, 0, tag=1)]) == (OK,)
    disk.close()
    engine.submit([WriteDisk(0, 3, tag=1)])
    with pytest.raises(RuntimeError, match=r"WriteDisk .*tickets 1\.\.1.*is closed"):
        engine.wait_all()


class _StuckDisk(DiskStore):
    """A disk whose writes hang until ``release`` is set, like a device that stopped answering."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.release = threading.Event()

    def write(self, slots, buffers):
        self.release.wait()
        return super().write(slots, buffers)


@pytest.mark.timeout(30)
def test_waits_on_a_stuck_worker_time_out_and_close_returns(tmp_path):
    kv = random_cache()
    host = HostBuffer(4, SPEC.bytes_per_block, pin=False)
    disk = _StuckDisk(tmp_path / "slots.bin", 4, host.slot_bytes)
    engine = TransferEngine(kv, host, disk, wait_timeout_s=0.5)
    try:
        engine.submit([Spill(0, 0, tag=1), WriteDisk(0, 2, tag=1)])
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"0\.5 s"):
            engine.wait_all()
        assert time.monotonic() - started < 5
        with pytest.raises(RuntimeError, match=r"0\.5 s"):  # failed for good
            engine.agree(None, wait=False)
        started = time.monotonic()
        engine.close()  # gives up on the stuck worker instead of joining it forever
        assert time.monotonic() - started < 5
    finally:
        disk.release.set()
        engine._worker.join(10)
        disk.close()
        host.close()
    with pytest.raises(ValueError, match="wait_timeout_s"):
        TransferEngine(kv, HostBuffer(1, SPEC.bytes_per_block, pin=False), wait_timeout_s=0)


def _agree_rank(rank: int, init_method: str, results) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    cpu_group = dist.new_group([0, 1], backend="gloo")
    kv = random_cache(seed=rank)
    host = HostBuffer(4, SPEC.bytes_per_block, pin=False)
    engine = TransferEngine(kv, host)
    engine.submit([Spill(0, 0, tag=1), Spill(1, 1, tag=2)])
    engine.wait_all()
    if rank == 1:
        host.slot(1)[0] ^= 0xFF
    engine.submit([Restore(0, 2, tag=1), Restore(1, 3, tag=2)])
    agreed = engine.agree(cpu_group, wait=True)
    restored_locally = torch.equal(block(kv, 3), block(kv, 1))
    engine.close()
    results.put((rank, agreed.first_ticket, agreed.statuses, engine.num_committed,
                 restored_locally))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_ranks_agree_on_the_worst_status():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = free_tcp_init_method()
    procs = [ctx.Process(target=_agree_rank, args=(r, init_method, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    expected = (0, (OK, OK, OK, CHECKSUM), 4)
    assert rows == [(0, *expected, True), (1, *expected, False)]


def test_an_index_written_under_another_checksum_is_not_trusted(tiers):
    """mix64 checksums on disk mean nothing to an xxh3 engine (and back): a cold cache, not a
    checksum failure on every block."""
    kv, _, _, make_engine = tiers
    engine = make_engine()
    assert run(engine, [Spill(0, 0, tag=1), WriteDisk(0, 2, tag=1), SaveIndex()]) == (OK,) * 3
    engine.close()
    assert make_engine().disk_tags() == {2: 1}
    other = "xxh3" if engine.checksum.name == "mix64" else "mix64-device"
    assert make_engine(checksum=other).disk_tags() == {}


def test_device_hashing_reads_each_block_once_per_batch(tmp_path, monkeypatch):
    """One hash call per spill batch and per restore batch, whatever the number of blocks."""
    kv = random_cache()
    hasher = ReferenceBlockHasher(kv)
    calls = []
    original = hasher.hash_blocks
    monkeypatch.setattr(hasher, "hash_blocks", lambda ids: calls.append(list(ids)) or original(ids))
    host = HostBuffer(8, SPEC.bytes_per_block, pin=False)
    engine = TransferEngine(kv, host, checksum=mix64_strategy(hasher))
    try:
        assert run(engine, [Spill(b, b, tag=b) for b in range(4)]) == (OK,) * 4
        assert run(engine, [Restore(b, b + 4, tag=b) for b in range(4)]) == (OK,) * 4
    finally:
        engine.close()
        host.close()
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
