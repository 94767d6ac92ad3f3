"""How many requests the serving path holds at once, and who is turned away beyond that.

Three bounds, each set from the configuration in one place (``cluster.app``):

1. A TP group holds at most ``group_max_ongoing_requests`` requests (Serve's
   ``max_ongoing_requests`` of the group deployment): the sequences its engine can run at once
   (``max_num_seqs``, and never more than its KV blocks, one block per running sequence at
   least) plus as many again waiting in the engine, so the batch refills the step one finishes.
2. Each ingress replica lets at most ``max_queued_requests`` requests wait for a group slot
   (Serve's ``max_queued_requests`` of the group deployment: its handle raises
   ``BackPressureError``, answered 429 with ``Retry-After``).
3. Each ingress replica admits at most ``IngressAdmission.max_in_flight`` generation requests
   (every group full plus the queue): beyond it a request is answered 429 before its body is
   parsed, so the ingress's memory stays bounded under any load.

Pure: no Ray.
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.api.protocol import ProtocolError

DEFAULT_RETRY_AFTER_S = 1.0


def group_max_ongoing_requests(max_num_seqs: int, num_kv_blocks: Optional[int]) -> int:
    """Requests one TP group holds: what it runs at once, and as many again waiting.

    ``num_kv_blocks`` None: the pool is sized from memory for ``max_num_seqs`` sequences."""
    if max_num_seqs < 1 or (num_kv_blocks is not None and num_kv_blocks < 1):
        raise ValueError(f"max_num_seqs and num_kv_blocks must be at least 1, got "
                         f"{max_num_seqs} and {num_kv_blocks}")
    num_running = min(max_num_seqs, num_kv_blocks or max_num_seqs)
    return 2 * num_running


def ingress_max_in_flight(num_groups: int, group_max_ongoing: int, max_queued: int) -> int:
    """Generation requests one ingress replica admits: every group full, plus its queue."""
    return num_groups * group_max_ongoing + max_queued


def overloaded(message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> ProtocolError:
    """429: the server is at its limit; the client should retry after ``retry_after_s``."""
    return ProtocolError(message, 429, code="overloaded", type="rate_limit_exceeded",
                         retry_after_s=retry_after_s)


class IngressAdmission:
    """Counts the generation requests in flight in one ingress replica (one event loop: no
    lock) and refuses the one past ``max_in_flight`` with a 429."""

    def __init__(self, max_in_flight: int, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.num_rejected = 0

    def acquire(self, count: int = 1, held: int = 0) -> Callable[[], None]:
        """Takes ``count`` slots for a request that holds ``held`` (a batch of prompts takes
        one per prompt beyond its request's own), or raises the 429 when they are not free (a
        400 when they never can be). Returns the slots' release (idempotent: a request releases
        them once, whichever way it ends)."""
        if self.num_in_flight + count > self.max_in_flight:
            self.num_rejected += 1
            if count + held > self.max_in_flight:
                raise ProtocolError(
                    f"a batch of {count + held} prompts is more than this server runs at once: "
                    f"send at most {self.max_in_flight} prompts per request", param="prompt")
            raise overloaded(f"the server is at its limit of {self.max_in_flight} requests in "
                             f"flight; retry after {self.retry_after_s:g} s",
                             self.retry_after_s)
        self.num_in_flight += count
        is_held = True

        def release() -> None:
            nonlocal is_held
            if is_held:
                is_held = False
                self.num_in_flight -= count

        return release
