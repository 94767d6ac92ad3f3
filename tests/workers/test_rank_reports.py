"""Every rank's failed collectives reach rank 0 (``LLMEngine.rank_reports``), by kind, and a
hang that the step watchdog declares is counted too, in real rank processes."""

import asyncio
import contextlib
import os
import signal
import time

import pytest

from workers.async_engine import AsyncLLMEngine, EngineDeadError
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]
NO_ERRORS = {"error": 0, "timeout": 0, "hang": 0}


def tp2(tiny_llama, step_timeout_s: float = 30.0) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama), tp_size=2, block_size=4, num_kv_blocks=32,
                        step_timeout_s=step_timeout_s)


def test_a_collective_failing_on_rank_1_is_counted_and_reported_to_rank_0(tiny_llama):
    engine = LLMEngine(tp2(tiny_llama, step_timeout_s=1.5))
    try:
        assert [(r.rank, r.collective_errors) for r in engine.rank_reports()] == [(0, NO_ERRORS)]
        # Rank 0 holds back its plans (a step, keepalives) past the step timeout: rank 1's
        # broadcast, waiting for the next plan, times out there.
        with engine._keepalive.lock:
            deadline = time.monotonic() + 20
            while len(engine.rank_reports()) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
        reports = {r.rank: r for r in engine.rank_reports()}
        assert reports[0].collective_errors == NO_ERRORS
        assert reports[1].collective_errors == {**NO_ERRORS, "timeout": 1}
        assert reports[1].memory is None  # a CPU rank has no device memory to report
        assert engine.collective_errors() == {**NO_ERRORS, "timeout": 1}
    finally:
        engine.shutdown(failed=True)


def test_a_hang_declared_by_the_watchdog_is_counted(tiny_llama):
    engine = AsyncLLMEngine(lambda: LLMEngine(tp2(tiny_llama)), hung_after_s=1.0)
    pid = engine.engine.child_ranks.pids[0]

    async def one():
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "r"):
            pass

    try:
        os.kill(pid, signal.SIGSTOP)  # rank 1 hangs: the group's collectives wait 30 s
        with pytest.raises(EngineDeadError, match="hung"):
            asyncio.run(one())
        assert engine.engine.collective_errors() == {**NO_ERRORS, "hang": 1}
        os.kill(pid, signal.SIGKILL)  # rank 0's collective now fails on the closed connection
        engine.shutdown(timeout_s=10)
        assert engine.engine.collective_errors() == {**NO_ERRORS, "hang": 1, "error": 1}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        engine.shutdown(timeout_s=5)
