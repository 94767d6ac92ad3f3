"""Snapshot files (round trip, every kind of damage is a warning and None) and the directory lock."""

import logging
from pathlib import Path
import subprocess
import sys

import pytest

from kv.tiers.disk.index import lock_directory, read_snapshot, warn_unknown_files, write_snapshot

REPO_ROOT = Path(__file__).resolve().parents[2]
RECORDS = [[1, 2, [3, 4]], [5, 6, []], [7, 8, [9]]]


def _read_warning(caplog, path, *args):
    """read_snapshot expecting None and exactly one warning naming the file; the warning text."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert read_snapshot(path, *args) is None
    assert len(caplog.records) == 1 and str(path) in caplog.text
    return caplog.text


def test_snapshot_round_trip_is_atomic_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "d" / "index.snap"
    write_snapshot(path, "disk-index", "model-a/l2", RECORDS)
    write_snapshot(path, "disk-index", "model-a/l2", RECORDS[:1])
    assert read_snapshot(path, "disk-index", "model-a/l2") == RECORDS[:1]
    assert [p.name for p in path.parent.iterdir()] == ["index.snap"]


def test_absent_snapshot_is_none_without_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert read_snapshot(tmp_path / "none.snap", "disk-index", "x") is None
    assert not caplog.records


def test_truncated_snapshot_is_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "index.snap"
    write_snapshot(path, "disk-index", "id", RECORDS)
    path.write_bytes(path.read_bytes()[:-5])
    assert "truncated" in _read_warning(caplog, path, "disk-index", "id")
    path.write_bytes(path.read_bytes()[:10])
    assert "truncated" in _read_warning(caplog, path, "disk-index", "id")


def test_snapshot_for_another_identity_or_kind_is_ignored(tmp_path, caplog):
    path = tmp_path / "index.snap"
    write_snapshot(path, "disk-index", "model-a", RECORDS)
    assert "another model or KV layout" in _read_warning(caplog, path, "disk-index", "model-b")
    assert "kind" in _read_warning(caplog, path, "host-index", "model-a")


def test_flipped_body_byte_fails_the_checksum(tmp_path, caplog):
    path = tmp_path / "index.snap"
    write_snapshot(path, "disk-index", "id", RECORDS)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert "checksum" in _read_warning(caplog, path, "disk-index", "id")


def test_file_that_is_not_a_snapshot_is_ignored(tmp_path, caplog):
    path = tmp_path / "index.snap"
    path.write_bytes(b"\xff\xfe garbage\nmore")
    assert "not" in _read_warning(caplog, path, "disk-index", "id")
    path.write_text('{"format": "tpserve-kv-snapshot", "version": 2}\n[]')
    assert "version 2" in _read_warning(caplog, path, "disk-index", "id")


_HOLD_LOCK = """
import sys
from kv.tiers.disk.index import lock_directory
lock = lock_directory(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_lock_held_by_another_process_raises(tmp_path):
    directory = tmp_path / "kvdir"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(directory)], cwd=REPO_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match="another engine"):
            lock_directory(directory)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with lock_directory(directory) as lock:  # released when the holder exits
        assert lock.is_held
        with pytest.raises(RuntimeError, match=str(directory)):
            lock_directory(directory)
    lock.release()  # idempotent
    lock_directory(directory).release()


def test_warn_unknown_files_names_each_stray_entry(tmp_path, caplog):
    lock = lock_directory(tmp_path)
    (tmp_path / "slots.bin").write_bytes(b"")
    (tmp_path / "stray.txt").write_bytes(b"")
    (tmp_path / ".tmp.index.snap.123").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert warn_unknown_files(tmp_path, {"slots.bin", "index.snap"}) == ["stray.txt"]
    assert len(caplog.records) == 1 and "stray.txt" in caplog.text and "ignored" in caplog.text
    assert warn_unknown_files(tmp_path / "missing", set()) == []
    lock.release()
