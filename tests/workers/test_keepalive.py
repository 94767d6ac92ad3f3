"""The keepalive thread sends only after a silence, never during a step, never when told not to."""

import threading
import time

import pytest

from workers.keepalive import PlanKeepalive


def test_it_sends_after_silence_and_waits_for_a_running_step():
    sent = []
    keepalive = PlanKeepalive(lambda: sent.append(time.monotonic()), lambda: True, 0.2)
    try:
        time.sleep(0.5)
        assert len(sent) >= 1  # idle from the start: sent at once, then every interval
        with keepalive.lock:  # a long step: nothing is sent meanwhile
            count = len(sent)
            time.sleep(0.6)
            assert len(sent) == count
            keepalive.sent()  # the step broadcast its own plan
        time.sleep(0.1)
        assert len(sent) == count  # its plan counts as one: the silence starts again
    finally:
        keepalive.close()


def test_it_does_not_send_while_transfers_are_outstanding():
    outstanding = threading.Event()
    outstanding.set()
    sent = []
    keepalive = PlanKeepalive(lambda: sent.append(1), lambda: not outstanding.is_set(), 0.1)
    try:
        time.sleep(0.4)
        assert sent == []
        outstanding.clear()
        time.sleep(0.4)
        assert sent
    finally:
        keepalive.close()


def test_bad_interval():
    with pytest.raises(ValueError, match="interval"):
        PlanKeepalive(lambda: None, lambda: True, 0)
