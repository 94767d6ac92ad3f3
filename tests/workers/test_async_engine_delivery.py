"""How the engine thread hands outputs to the event loop: one wake-up per loop and step, and
outputs queued behind a slow reader merged into one."""

import asyncio
import threading

import pytest

from workers.async_engine import AsyncLLMEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncLLMEngine(lambda: LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4,
                                                        num_kv_blocks=128)))
    yield eng
    eng.shutdown()


async def until_idle(engine, timeout_s: float = 10.0) -> None:
    """Until the engine has run every request: a load report taken after this call (they are
    refreshed after each step) says none runs or waits; at most ``timeout_s``."""
    seq = engine.load.seq
    for _ in range(int(timeout_s / 0.02)):
        await asyncio.sleep(0.02)
        load = engine.load
        if load.seq > seq and load.num_running == 0 and load.num_waiting == 0:
            return


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the wake-ups other threads ask of it, by thread name."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups_by_thread = {}

    def call_soon_threadsafe(self, callback, *args, context=None):
        name = threading.current_thread().name
        self.wakeups_by_thread[name] = self.wakeups_by_thread.get(name, 0) + 1
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_a_step_wakes_the_loop_once_for_all_its_requests(engine):
    num_requests, num_tokens = 4, 6
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)

    async def main():
        async def one(i):
            return [o async for o in engine.generate([5 + i, 6, 7], params, f"w{i}")]
        return await asyncio.gather(*(one(i) for i in range(num_requests)))

    loop = CountingLoop()
    try:
        streams = loop.run_until_complete(main())
    finally:
        loop.close()
    assert all(sum(len(o.new_token_ids) for o in s) == num_tokens for s in streams)
    # One wake-up per accepted request (its add), then one per step; a step produces a token
    # for every request it runs, and the requests join within a step or two of each other.
    wakeups = loop.wakeups_by_thread["tpserve-engine"]
    assert wakeups <= num_requests + num_tokens + 2, loop.wakeups_by_thread


def test_outputs_queued_behind_a_slow_reader_arrive_as_one(engine, tiny_llama):
    prompt, num_tokens = [9, 10, 11, 12], 8
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)

    async def main():
        stream = engine.generate(prompt, params, "slow")
        first = await stream.__anext__()
        await until_idle(engine)  # the reader is busy until the engine finished the request
        rest = [o async for o in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert len(rest) == 1  # every later step's output in one
    merged = rest[0]
    assert merged.finished and merged.finish_reason == "length"
    assert first.new_token_ids + merged.new_token_ids == merged.output_token_ids
    assert len(merged.output_token_ids) == num_tokens
    assert first.delta_text + merged.delta_text == merged.text
    with LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64)) as sync:
        rid = sync.add_request(prompt, params)
        final = None
        while sync.has_unfinished():
            final = next((o for o in sync.step() if o.request_id == rid), final)
    assert merged.output_token_ids == final.output_token_ids


def test_merged_outputs_keep_each_tokens_logprob(engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)

    async def main():
        stream = engine.generate([3, 4, 5], params, "lp")
        first = await stream.__anext__()
        await until_idle(engine)
        return [first] + [o async for o in stream]

    outputs = asyncio.run(main())
    assert len(outputs) == 2
    merged = outputs[-1]
    assert len(merged.logprobs) == len(merged.output_token_ids) == 5
    # What a group sends for the merged output: the logprobs of its own new tokens.
    new = merged.logprobs[-len(merged.new_token_ids):]
    assert [t.token_id for t in new] == merged.new_token_ids == merged.output_token_ids[1:]
