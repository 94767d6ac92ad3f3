"""Disk store: batched round trips, coalescing, O_DIRECT and its fallback, per-slot I/O errors."""

import errno
import json
import logging
import os
from pathlib import Path
import subprocess
import sys

import pytest

from kv.tiers.disk.store import DiskStore, aligned_buffer, plan_runs

SLOT = 4096
REPO_ROOT = Path(__file__).resolve().parents[2]


def _slot_views(num_slots, fill=None):
    """``num_slots`` aligned slot-sized views; slot view ``i`` filled with byte ``fill(i)``."""
    buf = aligned_buffer(num_slots * SLOT)
    views = [memoryview(buf)[i * SLOT:(i + 1) * SLOT] for i in range(num_slots)]
    if fill is not None:
        for i, view in enumerate(views):
            view[:] = bytes([fill(i) % 256]) * SLOT
    return views


def _accepts_direct(directory):
    """Whether a file in ``directory`` can be opened with O_DIRECT (without the store)."""
    probe = Path(directory) / f".direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    os.close(fd)
    return True


def test_batch_round_trip_coalesces_consecutive_slots(tmp_path):
    store = DiskStore(tmp_path / "kv" / "slots.bin", num_slots=16, slot_bytes=SLOT)
    slots = [5, 3, 10, 4, 0, 6]
    assert store.write(slots, _slot_views(6, fill=lambda i: slots[i] + 1)) == [None] * 6
    assert store.num_io_calls == 3  # [0], [3..6], [10]
    assert store.num_bytes_written == 6 * SLOT
    read_slots = [10, 0, 4, 3]
    out = _slot_views(4)
    assert store.read(read_slots, out) == [None] * 4
    for slot, view in zip(read_slots, out):
        assert bytes(view) == bytes([slot + 1]) * SLOT
    assert store.num_io_calls == 3 + 3 and store.num_bytes_read == 4 * SLOT
    store.close()
    store.close()  # idempotent


def test_max_io_bytes_and_iov_max_split_calls(tmp_path):
    store = DiskStore(tmp_path / "slots.bin", num_slots=2048, slot_bytes=SLOT,
                      max_io_bytes=2 * SLOT)
    assert store.write(range(5), _slot_views(5, fill=lambda i: i)) == [None] * 5
    assert store.num_io_calls == 3  # [0, 1], [2, 3], [4]
    iov_max = os.sysconf("SC_IOV_MAX")
    runs = plan_runs(list(range(iov_max + 1)), SLOT, 1 << 40, iov_max)
    assert [len(run) for run in runs] == [iov_max, 1]


def test_direct_io_is_used_where_the_filesystem_supports_it(tmp_path, caplog):
    if not _accepts_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    with caplog.at_level(logging.WARNING), DiskStore(tmp_path / "s.bin", 4, SLOT) as store:
        assert store.is_direct
        assert store.write([1], _slot_views(1, fill=lambda i: 7)) == [None]
        assert store.is_direct
    assert not caplog.records


def test_buffered_fallback_on_a_filesystem_that_refuses_direct_io(tmp_path, caplog):
    shm = Path("/dev/shm")
    if not shm.is_dir() or _accepts_direct(shm):
        pytest.skip("no filesystem refusing O_DIRECT here (tmpfs accepts it from Linux 6.6)")
    path = shm / f"tpserve-test-{os.getpid()}" / "slots.bin"
    try:
        with caplog.at_level(logging.WARNING), DiskStore(path, 4, SLOT) as store:
            assert not store.is_direct
            assert store.write([2], _slot_views(1, fill=lambda i: 9)) == [None]
            out = _slot_views(1)
            assert store.read([2], out) == [None] and bytes(out[0]) == b"\x09" * SLOT
        assert len(caplog.records) == 1 and "buffered" in caplog.text and str(path) in caplog.text
    finally:
        path.unlink(missing_ok=True)
        path.parent.rmdir()


def test_einval_on_first_direct_io_reopens_buffered_and_retries(tmp_path, caplog):
    if not _accepts_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    store = DiskStore(tmp_path / "s.bin", 4, SLOT)
    unaligned = memoryview(bytearray(SLOT + 1))[1:]  # odd address: the kernel says EINVAL
    unaligned[:] = b"\x05" * SLOT
    with caplog.at_level(logging.WARNING):
        assert store.write([3], [unaligned]) == [None]
        assert store.write([0], [unaligned]) == [None]
    assert not store.is_direct
    assert len(caplog.records) == 1 and "buffered" in caplog.text
    out = _slot_views(2)
    assert store.read([3, 0], out) == [None, None]
    assert bytes(out[0]) == bytes(out[1]) == b"\x05" * SLOT
    store.close()


def test_reading_a_truncated_file_fails_exactly_the_missing_slots(tmp_path):
    path = tmp_path / "s.bin"
    store = DiskStore(path, 6, SLOT)
    store.write(range(6), _slot_views(6, fill=lambda i: i + 1))
    os.truncate(path, 2 * SLOT + 100)
    out = _slot_views(6)
    results = store.read([5, 0, 1, 2, 3, 4], out)
    assert [r is None for r in results] == [False, True, True, False, False, False]
    assert all(isinstance(r, OSError) for r in results if r is not None)
    assert bytes(out[1]) == b"\x01" * SLOT and bytes(out[2]) == b"\x02" * SLOT
    store.close()


_WRITE_UNDER_FSIZE_LIMIT = """
import json, resource, signal, sys
from pathlib import Path
from kv.tiers.disk.store import DiskStore, aligned_buffer
path, slot_bytes, limit = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
slots = [4, 0, 1, 2, 3]
buf = memoryview(aligned_buffer(len(slots) * slot_bytes))
buf[:] = b"\\x0b" * len(buf)
views = [buf[i * slot_bytes:(i + 1) * slot_bytes] for i in range(len(slots))]
with DiskStore(path, 5, slot_bytes) as store:
    results = store.write(slots, views)
print(json.dumps([None if r is None else r.errno for r in results]))
"""


def test_write_beyond_the_file_size_limit_fails_only_those_slots(tmp_path):
    path = tmp_path / "s.bin"
    DiskStore(path, 5, SLOT).close()  # sized before the limit applies (ftruncate obeys it too)
    done = subprocess.run([sys.executable, "-c", _WRITE_UNDER_FSIZE_LIMIT, str(path), str(SLOT),
                           str(2 * SLOT)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [errno.EFBIG, None, None, errno.EFBIG, errno.EFBIG]
    with DiskStore(path, 5, SLOT) as store:
        out = _slot_views(2)
        assert store.read([0, 1], out) == [None, None]
        assert bytes(out[0]) == bytes(out[1]) == b"\x0b" * SLOT


def test_reopening_keeps_the_bytes_and_only_grows_the_file(tmp_path):
    path = tmp_path / "s.bin"
    with DiskStore(path, 3, SLOT) as store:
        store.write([0, 2], _slot_views(2, fill=lambda i: 0x40 + i))
        store.sync()
    with DiskStore(path, 8, SLOT) as store:
        assert path.stat().st_size == 8 * SLOT
        out = _slot_views(2)
        assert store.read([0, 2], out) == [None, None]
        assert bytes(out[0]) == b"\x40" * SLOT and bytes(out[1]) == b"\x41" * SLOT
    DiskStore(path, 2, SLOT).close()
    assert path.stat().st_size == 8 * SLOT


def test_bad_arguments_raise_value_error_naming_them(tmp_path):
    with pytest.raises(ValueError, match="slot_bytes=1000"):
        DiskStore(tmp_path / "a.bin", 4, 1000)
    with pytest.raises(ValueError, match="num_slots=0"):
        DiskStore(tmp_path / "a.bin", 0, SLOT)
    with pytest.raises(ValueError, match="num_bytes=0"):
        aligned_buffer(0)
    store = DiskStore(tmp_path / "b.bin", 4, SLOT)
    views = _slot_views(2)
    with pytest.raises(ValueError, match="slot 4 out of range"):
        store.write([4], views[:1])
    with pytest.raises(ValueError, match="2 slots but 1 buffers"):
        store.write([0, 1], views[:1])
    with pytest.raises(ValueError, match="has 100 bytes"):
        store.read([0], [views[0][:100]])
    with pytest.raises(ValueError, match="read-only"):
        store.read([0], [memoryview(bytes(SLOT))])
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.write([0], views[:1])


def test_concurrent_calls_on_disjoint_slots(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    store = DiskStore(tmp_path / "slots.bin", num_slots=64, slot_bytes=SLOT, max_io_bytes=SLOT * 4)
    halves = [list(range(0, 32)), list(range(32, 64))]
    with ThreadPoolExecutor(2) as pool:
        written = list(pool.map(lambda s: store.write(s, _slot_views(32, lambda i: s[i] % 251)),
                                halves))
        out = [_slot_views(32), _slot_views(32)]
        read = list(pool.map(lambda k: store.read(halves[k], out[k]), [0, 1]))
    assert written == read == [[None] * 32, [None] * 32]
    for half, views in zip(halves, out):
        assert [bytes(v[:1])[0] for v in views] == [slot % 251 for slot in half]
    assert store.num_bytes_written == store.num_bytes_read == 64 * SLOT
    assert store.num_io_calls == 2 * 2 * 8  # 4-slot calls: 8 per half, writes and reads
