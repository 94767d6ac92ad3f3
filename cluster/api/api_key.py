"""The API key: where it comes from, and how each ingress replica checks requests against it.

A key reaches the application one of three ways, resolved where the application is built (the
driver of ``tpserve serve``; the Serve controller's build task on the head for ``serve deploy``):

- ``--api-key`` / ``$TPSERVE_API_KEY``: the value itself;
- a config file's ``api_key_env: NAME``: the environment variable ``NAME`` of the process that
  builds the application (the app's ``runtime_env``, or the raylet's environment on the head);
- ``--api-key-file PATH`` / ``$TPSERVE_API_KEY_FILE`` / a config file's ``api_key_file``: a file
  holding the key (a mounted Kubernetes Secret, a file that ``ray up`` copies to every node).

A key file holds one key per line; every non-empty line is a valid key, so a rotation can add
the new key, move the clients over, then drop the old one. Each ingress replica re-reads the file
on its own node when it changes (checked at most once per ``RECHECK_S``), so a rotated file takes
effect without a restart. A replica on a node without the file, or whose file turns unreadable or
empty, keeps the keys it has and logs it once: a broken file never opens the API.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

from cluster.api.protocol import ProtocolError

logger = logging.getLogger(__name__)

RECHECK_S = 1.0
MAX_KEY_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ApiKey:
    """The keys the ingress accepts, as read where the application was built, and the file they
    came from (None: a value given directly, fixed for the application's life)."""

    keys: Tuple[str, ...] = field(repr=False)
    file: Optional[str] = None  # as given: a `~` is expanded on the node that reads it

    def __post_init__(self) -> None:
        if not self.keys or not all(self.keys):
            raise ValueError("an API key must be a non-empty string")


def read_key_file(path: str, name: str = "--api-key-file") -> Tuple[str, ...]:
    """The keys in the file at ``path`` (``~`` expanded here); ``ValueError`` naming ``name``,
    the path and this host when the file is missing, unreadable, too large or holds no key."""
    where = f"{name}: {path}"
    host = socket.gethostname()
    full = os.path.expanduser(path)
    try:
        with open(full, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file on {host}, where the application is built; "
                         f"create it there (or mount it) before deploying") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it on {host}: {exc.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{where}: larger than {MAX_KEY_FILE_BYTES} bytes; expected one API "
                         f"key per line")
    try:
        keys = parse_keys(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8 text; expected one API key per line") from None
    if not keys:
        raise ValueError(f"{where}: empty on {host}; expected one API key per line")
    return keys


def parse_keys(text: str) -> Tuple[str, ...]:
    """The non-empty lines of ``text``, stripped: each one a key."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def resolve_api_key(value: Optional[str], key_file: Optional[str]) -> Optional[ApiKey]:
    """The application's key from ``--api-key`` (``value``) or ``--api-key-file``: at most one;
    None: serve without a key."""
    if value is not None and key_file is not None:
        raise ValueError("--api-key and --api-key-file: give one of them, not both")
    if key_file is not None:
        return ApiKey(read_key_file(key_file), file=key_file)
    if value is not None:
        if not value.strip():
            raise ValueError("--api-key: empty; give a key or leave it out")
        return ApiKey((value.strip(),))
    return None


class KeyCheck:
    """One replica's check of ``Authorization`` values against the key (see the module doc)."""

    def __init__(self, key: Optional[ApiKey], recheck_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._keys = tuple(k.encode() for k in key.keys) if key is not None else ()
        self._file = os.path.expanduser(key.file) if key is not None and key.file else None
        self._recheck_s = recheck_s
        self._clock = clock
        self._next_check = 0.0
        self._seen: Optional[Tuple[int, int, int]] = None
        self._complained = False

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authorize(self, authorization: Optional[str]) -> None:
        """Raises a 401 ``ProtocolError`` unless ``authorization`` is ``Bearer <a key>``."""
        if not self._keys:
            return
        self._refresh()
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ProtocolError("missing API key: send 'Authorization: Bearer <key>'", 401,
                                code="invalid_api_key")
        given = token.strip().encode()
        # Compare with every key, so the time taken does not tell which one nearly matched.
        if not sum(hmac.compare_digest(given, key) for key in self._keys):
            raise ProtocolError("incorrect API key provided", 401, code="invalid_api_key")

    def _refresh(self) -> None:
        if self._file is None or self._clock() < self._next_check:
            return
        self._next_check = self._clock() + self._recheck_s
        try:
            st = os.stat(self._file)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._seen:
                return
            keys = read_key_file(self._file)
        except (OSError, ValueError) as exc:
            self._complain(f"API key file {self._file} unusable here ({exc}); keeping the "
                           f"keys this replica has")
            return
        if self._seen is not None and tuple(k.encode() for k in keys) != self._keys:
            logger.info("API keys reloaded from %s (%d key(s))", self._file, len(keys))
        self._seen = stamp
        self._keys = tuple(k.encode() for k in keys)
        self._complained = False

    def _complain(self, message: str) -> None:
        if not self._complained:
            logger.warning(message)
            self._complained = True
