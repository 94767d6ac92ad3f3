"""Striped disk store: the slot mapping, round trips over three directories, per-directory
errors, and that one directory is the plain store's file."""

import json
import os
import subprocess
import sys
import threading

import pytest

from kv.tiers.disk.store import DiskStore
from kv.tiers.disk.striped import StripeLayout, StripedDiskStore, stripe_unit_slots

from test_disk_store import REPO_ROOT, SLOT, _slot_views


def _paths(tmp_path, n):
    return [tmp_path / f"d{i}" / "blocks.bin" for i in range(n)]


@pytest.mark.parametrize("num_slots,num_dirs,unit", [(10, 3, 3), (12, 3, 4), (7, 1, 3),
                                                     (100, 4, 8), (5, 5, 1), (9, 2, 16)])
def test_every_global_slot_maps_to_exactly_one_local_slot(num_slots, num_dirs, unit):
    layout = StripeLayout(num_slots, num_dirs, unit)
    places = [layout.locate(s) for s in range(num_slots)]
    assert len(set(places)) == num_slots  # no two slots share a place
    for directory in range(num_dirs):
        local = sorted(lo for d, lo in places if d == directory)
        assert local == list(range(layout.num_local_slots(directory)))  # dense, no hole
    assert [layout.global_slot(d, lo) for d, lo in places] == list(range(num_slots))


def test_units_rotate_over_the_directories():
    layout = StripeLayout(num_slots=40, num_dirs=3, unit_slots=4)
    assert [layout.locate(s)[0] for s in range(0, 40, 4)] == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    # Inside a unit local slots are consecutive (they coalesce); the next row follows on.
    assert [layout.locate(s) for s in (12, 13, 14, 15, 16)] == [(0, 4), (0, 5), (0, 6), (0, 7),
                                                               (1, 4)]
    assert [layout.num_local_slots(d) for d in range(3)] == [16, 12, 12]


def test_unit_is_one_large_io_unless_too_few_slots():
    assert stripe_unit_slots(1 << 20, SLOT, 3, 8 << 20) == 2048  # 8 MiB of 4 KiB slots
    assert stripe_unit_slots(64, SLOT, 3, 8 << 20) == 21  # every directory gets a unit
    with pytest.raises(ValueError, match="fewer than its 3 directories"):
        StripeLayout(2, 3, 1)


def test_round_trip_across_three_directories(tmp_path):
    store = StripedDiskStore(_paths(tmp_path, 3), num_slots=24, slot_bytes=SLOT,
                             max_io_bytes=4 * SLOT)  # units of 4 slots
    assert store.layout.unit_slots == 4 and store.max_io_bytes == 12 * SLOT
    slots = [23, 0, 5, 4, 13, 12, 1, 8, 9, 2, 3]
    assert store.write(slots, _slot_views(len(slots), fill=lambda i: slots[i] + 1)) == \
        [None] * len(slots)
    # Slots 0..3 are one call in d0; 4, 5 one in d1; 8, 9 one in d2; 12, 13 one in d0; 23 in d2.
    assert store.num_io_calls == 5
    assert [store.stores[d].num_io_calls for d in range(3)] == [2, 1, 2]
    out = _slot_views(len(slots))
    assert store.read(list(reversed(slots)), out) == [None] * len(slots)
    for slot, view in zip(reversed(slots), out):
        assert bytes(view) == bytes([slot + 1]) * SLOT
    # The bytes are in each directory's file at the local slot.
    d0 = (tmp_path / "d0" / "blocks.bin").read_bytes()
    assert d0[4 * SLOT:5 * SLOT] == bytes([13]) * SLOT  # global 12 -> d0 local 4
    written = store.directory_bytes()
    assert [w for w, _ in written] == [6 * SLOT, 2 * SLOT, 3 * SLOT]  # d2: 8, 9 and 23
    assert [r for _, r in written] == [6 * SLOT, 2 * SLOT, 3 * SLOT]
    assert store.num_bytes_written == len(slots) * SLOT
    store.sync()
    store.close()
    store.close()


def test_one_directory_is_the_plain_store_file(tmp_path):
    path = tmp_path / "blocks.bin"
    with StripedDiskStore([path], num_slots=8, slot_bytes=SLOT) as striped:
        assert striped.layout_identity == ""
        assert striped.write([6, 2], _slot_views(2, fill=lambda i: 40 + i)) == [None, None]
    assert path.stat().st_size == 8 * SLOT
    with DiskStore(path, 8, SLOT) as plain:  # what an earlier engine wrote reads the same
        out = _slot_views(2)
        assert plain.read([6, 2], out) == [None, None]
        assert bytes(out[0]) == bytes([40]) * SLOT and bytes(out[1]) == bytes([41]) * SLOT


def test_layout_identity_names_count_and_order(tmp_path):
    a, b, c = _paths(tmp_path, 3)
    identities = []
    for paths in ([a, b], [b, a], [a, b, c]):
        with StripedDiskStore(paths, num_slots=12, slot_bytes=SLOT) as store:
            identities.append(store.layout_identity)
    assert len(set(identities)) == 3 and all(identities)


def test_bad_arguments_raise(tmp_path):
    with StripedDiskStore(_paths(tmp_path, 2), num_slots=4, slot_bytes=SLOT) as store:
        with pytest.raises(ValueError, match="slot 4 out of range"):
            store.write([4], _slot_views(1))
        with pytest.raises(ValueError, match="one buffer per slot"):
            store.read([0, 1], _slot_views(1))
    with pytest.raises(ValueError, match="fewer than its 3 directories"):
        StripedDiskStore(_paths(tmp_path, 3), num_slots=2, slot_bytes=SLOT)
    with pytest.raises(ValueError, match="is closed"):
        store.read([0, 1], _slot_views(2))


def test_the_parts_of_a_call_run_at_once(tmp_path):
    """One part per directory, all in flight together: three parts that each wait for the
    other two finish only if they run at the same time."""
    with StripedDiskStore(_paths(tmp_path, 3), num_slots=12, slot_bytes=SLOT) as store:
        barrier = threading.Barrier(3, timeout=10)
        assert sorted(store._run_all([(barrier.wait, ())] * 3)) == [0, 1, 2]


def test_a_read_error_in_one_directory_fails_only_its_slots(tmp_path):
    store = StripedDiskStore(_paths(tmp_path, 3), num_slots=12, slot_bytes=SLOT)  # units of 4
    slots = list(range(12))
    assert store.write(slots, _slot_views(12, fill=lambda i: i + 1)) == [None] * 12
    os.truncate(tmp_path / "d1" / "blocks.bin", 0)  # the drive of d1 lost its data
    out = _slot_views(12)
    errors = store.read(slots, out)
    assert [i for i, e in enumerate(errors) if e is not None] == [4, 5, 6, 7]
    assert all(bytes(out[i]) == bytes([i + 1]) * SLOT for i in (0, 1, 2, 3, 8, 9, 10, 11))
    store.close()


WRITE_ERROR_SCRIPT = """
import json, resource, signal, sys
from kv.tiers.disk.store import aligned_buffer
from kv.tiers.disk.striped import StripedDiskStore
store = StripedDiskStore(json.loads(sys.argv[1]), num_slots=24, slot_bytes=4096,
                         max_io_bytes=8 * 4096)  # units of 8: d0 holds 0..7 and 16..23
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
# From here on no write may reach past the first slot of a file: it fails with EFBIG.
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
buf = aligned_buffer(3 * 4096)
views = [memoryview(buf)[i * 4096:(i + 1) * 4096] for i in range(3)]
errors = store.write([0, 9, 10], views)  # d0 local slot 0; d1 local slots 1 and 2
print(json.dumps([None if e is None else e.errno for e in errors]))
"""


def test_a_write_error_in_one_directory_fails_only_its_slots(tmp_path):
    import errno
    paths = [str(p) for p in _paths(tmp_path, 2)]
    result = subprocess.run([sys.executable, "-c", WRITE_ERROR_SCRIPT, json.dumps(paths)],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    # The kernel refuses d1's writes (past the limit); d0's slot, written at the same time, is in.
    assert json.loads(result.stdout) == [None, errno.EFBIG, errno.EFBIG]
