"""Where one rank's transfer worker stands: what it has finished, what callers wait for, and
whether it failed.

The worker thread reports each finished run of ops (``finish``) and each group of spills whose
device side has been read (``mark_spills_read``); callers wait for those (``wait_all``,
``wait_device_reads``) and take the finished statuses in ticket order (``take``).

A worker that raised, or one that keeps a caller waiting past ``timeout_s``, fails the progress for
good (``fail``): every waiter wakes, and every later call raises ``TransferError`` naming what
failed and why. A broken worker thus fails the engine step (and the engine, whose host replaces
the group) instead of hanging every rank.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Optional

import torch

from kv.tiers.ops import OpStatus

logger = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A rank's transfer worker failed or stopped making progress; its tiers are unusable."""


class TransferProgress:
    """Counts, statuses and failure of one rank's transfers, guarded by one condition variable.

    Costs: every call O(1) plus the statuses it moves; a wait blocks at most ``timeout_s``.
    """

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be a positive number of seconds, got "
                             f"{timeout_s!r}")
        self.timeout_s = timeout_s
        self.num_submitted = 0
        self.num_committed = 0
        self._done: List[OpStatus] = []  # statuses of tickets [num_committed, num_done)
        self._num_spills_submitted = 0
        self._num_spills_read = 0  # spills whose device side is done (CPU) or queued (CUDA)
        self._spills_read_event: Optional[torch.cuda.Event] = None  # CUDA: after the last ones
        self._failure: Optional[str] = None
        self._cause: Optional[BaseException] = None
        self._cond = threading.Condition()

    # ----- caller side -----

    def add_submitted(self, num_ops: int, num_spills: int) -> None:
        """Count ops about to be queued; raises ``TransferError`` if the worker failed."""
        with self._cond:
            self._raise_if_failed()
            self.num_submitted += num_ops
            self._num_spills_submitted += num_spills

    def num_done(self) -> int:
        """Length of the completed prefix of tickets."""
        with self._cond:
            return self.num_committed + len(self._done)

    def wait_all(self) -> None:
        """Return once every submitted op is done; raises ``TransferError`` on failure or after
        ``timeout_s``."""
        self._wait(lambda: self.num_committed + len(self._done) >= self.num_submitted,
                   "waiting for every queued tier op")

    def wait_device_reads(self) -> Optional[torch.cuda.Event]:
        """Return once every submitted spill has read its device block (CPU) or queued the read
        (CUDA: the event to wait for); raises like ``wait_all``."""
        self._wait(lambda: self._num_spills_read >= self._num_spills_submitted,
                   "waiting for queued spills to read their device blocks")
        with self._cond:
            return self._spills_read_event

    def take(self, end_ticket: int) -> List[OpStatus]:
        """Commit tickets ``num_committed..end_ticket-1`` (all done) and return their statuses.

        Never raises for a failure: it runs between two collectives, which every rank must
        enter; a failure raises at the caller's next check instead."""
        with self._cond:
            count = end_ticket - self.num_committed
            assert 0 <= count <= len(self._done), "committing tickets that are not done"
            statuses = self._done[:count]
            del self._done[:count]
            self.num_committed = end_ticket
            return statuses

    @property
    def is_failed(self) -> bool:
        with self._cond:
            return self._failure is not None

    def check(self) -> None:
        """Raise ``TransferError`` if the worker failed."""
        with self._cond:
            self._raise_if_failed()

    # ----- worker side -----

    def finish(self, statuses: List[OpStatus]) -> None:
        """The next ``len(statuses)`` tickets are done."""
        with self._cond:
            self._done.extend(statuses)
            self._cond.notify_all()

    def mark_spills_read(self, num_spills: int, event: Optional[torch.cuda.Event]) -> None:
        """``num_spills`` more spills have read their device blocks (on CUDA: before ``event``)."""
        with self._cond:
            self._num_spills_read += num_spills
            if event is not None:
                self._spills_read_event = event
            self._cond.notify_all()

    def fail(self, what: str, cause: Optional[BaseException]) -> None:
        """Fail for good (the first failure wins) and wake every waiter."""
        with self._cond:
            self._fail_locked(what, cause)

    # ----- helpers -----

    def _wait(self, is_done: Callable[[], bool], what: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._failure is not None or is_done(), self.timeout_s)
            if self._failure is None and not is_done():
                self._fail_locked(f"{what}: not done within {self.timeout_s:g} s (the transfer "
                                  "worker is stuck)", None)
            self._raise_if_failed()

    def _fail_locked(self, what: str, cause: Optional[BaseException]) -> None:
        if self._failure is not None:
            return
        self._failure, self._cause = what, cause
        logger.error("KV transfers failed: %s", what, exc_info=cause)
        self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise TransferError(f"KV transfers failed: {self._failure}") from self._cause
