"""The watchdog's deadline follows recent steps above its floor and fires once, on a hung step."""

import threading
import time

import pytest

from workers.step_watchdog import StepHungError, StepWatchdog


def test_a_step_past_the_deadline_is_declared_hung_once():
    fired = []
    done = threading.Event()

    def on_hung(error):
        fired.append(error)
        done.set()

    watchdog = StepWatchdog(0.4, on_hung)
    try:
        with watchdog.step():
            time.sleep(0.05)  # a normal step
        assert 0.5 <= watchdog.deadline_s() < 1.5  # 10 x the 0.05 s step, above the floor
        with watchdog.step():
            assert done.wait(5.0)  # a step that never ends
        assert len(fired) == 1 and isinstance(fired[0], StepHungError)
        assert "past its deadline" in str(fired[0])
    finally:
        watchdog.close()


def test_steps_under_the_deadline_never_fire():
    fired = []
    watchdog = StepWatchdog(0.3, fired.append)
    try:
        for _ in range(5):
            with watchdog.step():
                time.sleep(0.1)
        assert fired == []
    finally:
        watchdog.close()


def test_bad_floor():
    with pytest.raises(ValueError, match="floor"):
        StepWatchdog(0, lambda e: None)
