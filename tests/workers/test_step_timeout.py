"""``step_timeout_s``: how long a collective of a TP group may wait (a hung rank's bound), and
what keeps an idle group alive meanwhile (keepalive plans), in real rank processes."""

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

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_an_idle_group_outlives_its_step_timeout(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), tp_size=2, block_size=4, num_kv_blocks=32,
                          step_timeout_s=2.0)
    with LLMEngine(config) as engine:
        from workers.llm import LLM

        llm = LLM.__new__(LLM)
        llm.engine = engine
        first = llm.generate([[5, 6, 7]], GREEDY)[0].output_token_ids
        time.sleep(7.0)  # idle: over three step timeouts with no request
        assert llm.generate([[5, 6, 7]], GREEDY)[0].output_token_ids == first


def test_a_hung_rank_fails_the_step_within_the_deadline(tiny_llama):
    config = EngineConfig(model=str(tiny_llama), tp_size=2, block_size=4, num_kv_blocks=64,
                          step_timeout_s=3.0)
    engine = AsyncLLMEngine(lambda: LLMEngine(config))
    pid = engine.engine.child_ranks.pids[0]

    async def stream():
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async for out in engine.generate([5, 6, 7], params, "r"):
            if len(out.output_token_ids) == 3:
                os.kill(pid, signal.SIGSTOP)  # rank 1 hangs mid-stream

    started = time.monotonic()
    try:
        # The watchdog or the collective's own timeout, whichever comes first: both are the
        # step timeout (3 s), not the 600 s of before.
        with pytest.raises(EngineDeadError, match="hung|Timed out"):
            asyncio.run(stream())
        assert time.monotonic() - started < 20
        assert not engine.is_alive
        # The failed group is stopped with its rank still frozen: the rank cannot take the
        # shutdown plan, so it is killed at once (a healthy rank gets 30 s to finish), and the
        # group's devices are free for its replacement without that wait.
        started = time.monotonic()
        engine.shutdown(timeout_s=5)
        assert time.monotonic() - started < 15
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        engine.shutdown(timeout_s=5)
