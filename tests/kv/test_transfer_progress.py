"""The transfer worker's progress: a failure wakes every waiter and is raised by every later call,
the first failure is the one reported, and committing done tickets never raises (it runs between
two collectives)."""

import threading

import pytest

from kv.tiers.ops import OpStatus
from kv.tiers.transfer_progress import TransferError, TransferProgress


@pytest.mark.timeout(30)
def test_a_failure_wakes_every_waiter_and_the_first_one_is_reported():
    progress = TransferProgress(timeout_s=60)
    progress.add_submitted(num_ops=2, num_spills=1)
    errors = []

    def wait(fn):
        try:
            fn()
        except TransferError as exc:
            errors.append(exc)

    waiters = [threading.Thread(target=wait, args=(fn,))
               for fn in (progress.wait_all, progress.wait_device_reads)]
    for waiter in waiters:
        waiter.start()
    progress.finish([OpStatus.OK])
    cause = OSError("device gone")
    progress.fail("Spill x1 (tickets 1..1)", cause)
    progress.fail("a later failure", None)
    for waiter in waiters:
        waiter.join(10)
    assert len(errors) == 2 and all(e.__cause__ is cause for e in errors)
    assert all("Spill x1 (tickets 1..1)" in str(e) for e in errors)
    assert progress.take(1) == [OpStatus.OK]  # between collectives: no raise
    with pytest.raises(TransferError, match="tickets 1..1"):
        progress.check()
    with pytest.raises(TransferError, match="tickets 1..1"):
        progress.add_submitted(1, 0)


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="wait_timeout_s"):
        TransferProgress(timeout_s=0)
