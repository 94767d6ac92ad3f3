"""What survives a restart of the disk tier: checksummed snapshot files and the directory lock.

A snapshot is one JSON header line, then a JSON body::

    {"format": "tpserve-kv-snapshot", "version": 1, "kind": ..., "identity": ...,
     "num_records": n, "body_bytes": b, "body_xxh3": "<hex>"}\\n
    [[...], [...], ...]

``identity`` names what the bytes on disk mean (model, KV layout, rank): a snapshot written for
another identity is ignored rather than trusted. Every way a file can be stale or damaged
(truncated, flipped bits, another format) makes :func:`read_snapshot` return None with one
warning, so a bad file costs a cold cache, never a crash or wrong KV.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Collection, List, Optional

import xxhash

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "tpserve-kv-snapshot"
SNAPSHOT_VERSION = 1
LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp"


class _BadSnapshot(Exception):
    """Why a snapshot file cannot be used (internal to :func:`read_snapshot`)."""


def write_snapshot(path: Path, kind: str, identity: str, records: list) -> None:
    """Atomically replace ``path`` with a snapshot of ``records`` (JSON-able lists of ints).

    Readers see either the old file or the complete new one, also after a crash: the bytes go to a
    temporary file in the same directory, are fsynced, renamed over ``path``, and the directory is
    fsynced. Costs two fsyncs plus serializing the records. Raises OSError if the write fails
    (the old file is then left as it was).
    """
    path = Path(path)
    body = json.dumps(records, separators=(",", ":")).encode()
    header = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "kind": kind,
              "identity": identity, "num_records": len(records), "body_bytes": len(body),
              "body_xxh3": xxhash.xxh3_64_hexdigest(body)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}.{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            file.write(json.dumps(header).encode() + b"\n" + body)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def read_snapshot(path: Path, kind: str, identity: str) -> Optional[list]:
    """The records of the snapshot at ``path``, or None if there is none that can be trusted.

    None without a word when the file does not exist; None with one warning naming the file and
    the reason when it cannot be read, is not a snapshot of this ``kind`` and version, was written
    for another ``identity``, is truncated, or fails its checksum. Never raises for file contents.
    Costs reading the whole file and one xxh3 pass over it.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("KV snapshot %s ignored: cannot read it: %s", path, exc)
        return None
    try:
        return _parse(data, kind, identity)
    except _BadSnapshot as exc:
        logger.warning("KV snapshot %s ignored: %s", path, exc)
        return None


def _parse(data: bytes, kind: str, identity: str) -> list:
    header_line, newline, body = data.partition(b"\n")
    header = _parse_header(header_line, newline, kind, identity)
    if len(body) != header["body_bytes"]:
        raise _BadSnapshot(f"truncated or corrupt: body has {len(body)} bytes, header says "
                           f"{header['body_bytes']}")
    if xxhash.xxh3_64_hexdigest(body) != header["body_xxh3"]:
        raise _BadSnapshot("checksum mismatch: the body is corrupt")
    try:
        records = json.loads(body)
    except ValueError as exc:
        raise _BadSnapshot(f"body is not valid JSON: {exc}") from None
    if not isinstance(records, list) or len(records) != header["num_records"]:
        raise _BadSnapshot(f"body is not a list of {header['num_records']} records")
    return records


def _parse_header(line: bytes, newline: bytes, kind: str, identity: str) -> dict:
    if not newline:
        raise _BadSnapshot("no header line (file truncated or not a snapshot)")
    try:
        header = json.loads(line)
    except ValueError:
        raise _BadSnapshot("header line is not JSON: not a tpserve KV snapshot") from None
    if not isinstance(header, dict) or header.get("format") != SNAPSHOT_FORMAT:
        raise _BadSnapshot(f"not a tpserve KV snapshot (format is not {SNAPSHOT_FORMAT!r})")
    if header.get("version") != SNAPSHOT_VERSION:
        raise _BadSnapshot(f"version {header.get('version')!r}, expected {SNAPSHOT_VERSION}")
    if header.get("kind") != kind:
        raise _BadSnapshot(f"kind {header.get('kind')!r}, expected {kind!r}")
    if header.get("identity") != identity:
        raise _BadSnapshot(f"written for another model or KV layout (identity "
                           f"{header.get('identity')!r}, this engine is {identity!r}) and is "
                           f"ignored")
    if not (_is_count(header.get("num_records")) and _is_count(header.get("body_bytes"))
            and isinstance(header.get("body_xxh3"), str)):
        raise _BadSnapshot("header fields num_records, body_bytes, body_xxh3 are malformed")
    return header


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/.lock``, held until :meth:`release`.

    The kernel drops it when the process dies, so a crashed engine never leaves a stale lock.
    """

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: Optional[int] = fd

    @property
    def is_held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close; idempotent."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_directory(directory: Path) -> DirectoryLock:
    """Create ``directory`` if needed and lock it for this engine (non-blocking).

    Raises RuntimeError naming the directory if another process (or another lock in this one)
    holds it: two engines writing the same slot file would corrupt each other's KV.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RuntimeError(f"KV disk directory {directory} is locked: another engine (pid "
                           f"{holder}) is using it; give each engine its own directory") from None
    except BaseException:
        os.close(fd)
        raise
    # The pid is only for the error message above; the lock itself is the flock.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DirectoryLock(directory, fd)


def warn_unknown_files(directory: Path, known: Collection[str]) -> List[str]:
    """Names in ``directory`` that are not in ``known``, each logged as ignored; sorted.

    The lock file and temporary files (``.tmp*``) are not reported. A missing directory has none.
    """
    directory = Path(directory)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    unknown = [name for name in names
               if name not in known and name != LOCK_NAME and not name.startswith(TMP_PREFIX)]
    for name in unknown:
        logger.warning("KV disk directory %s: unknown entry %r is ignored", directory, name)
    return unknown
