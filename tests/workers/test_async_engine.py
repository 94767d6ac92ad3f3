"""The engine on its thread, streamed to asyncio: concurrency, abort on cancel, errors."""

import asyncio
import time

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


async def collect(engine, prompt, request_id, **params):
    return [o async for o in engine.generate(prompt, SamplingParams(**params), request_id)]


def test_concurrent_streams_match_the_sync_engine(engine, tiny_llama):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 9]

    async def main():
        return await asyncio.gather(*(collect(engine, p, f"r{i}", max_tokens=6, temperature=0.0)
                                      for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    with LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64)) as sync:
        for prompt, stream in zip(prompts, streams):
            rid = sync.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0))
            final = None
            while sync.has_unfinished():
                final = next((o for o in sync.step() if o.request_id == rid), final)
            assert stream[-1].output_token_ids == final.output_token_ids
            assert [t for o in stream for t in o.new_token_ids] == final.output_token_ids


def test_cancelled_stream_aborts_the_request(engine):
    async def main():
        agen = engine.generate([3] * 5, SamplingParams(max_tokens=200, ignore_eos=True), "c1")
        await agen.__anext__()
        await agen.aclose()  # what a disconnecting client does
        for _ in range(50):
            await asyncio.sleep(0.02)
            if engine.load.num_running == 0 and engine.load.kv.num_used_blocks == 0:
                return True
        return False

    assert asyncio.run(main())


def test_bad_request_raises_to_the_caller_only(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await collect(engine, [], "bad")
        return await collect(engine, [4, 5], "good", max_tokens=2)

    assert len(asyncio.run(main())[-1].output_token_ids) == 2
    assert engine.is_alive


def test_an_idle_engine_keeps_its_load_report_fresh(engine):
    import time

    first = engine.load
    time.sleep(1.2)  # no requests: the engine thread only waits for commands
    assert engine.load.seq > first.seq and engine.load.time > first.time


def test_a_report_holds_every_request_accepted_before_it(engine):
    """A request accepted while the engine thread is inside a step waits in the command queue;
    a report taken then must still list it and count its tokens, or the router drops its charge
    and the request is in neither count."""
    prompt = [7] * 37

    async def main():
        busy = engine.generate([3] * 5, SamplingParams(max_tokens=100, ignore_eos=True), "busy")
        await busy.__anext__()  # the engine thread is stepping now
        accepted = engine.generate(prompt, SamplingParams(max_tokens=2), "acc", routing_id="rt-1")
        first = asyncio.ensure_future(accepted.__anext__())
        await asyncio.sleep(0)  # generate() has queued the request
        load = engine._snapshot_load()  # as if the engine thread reported now
        await first
        await accepted.aclose()
        await busy.aclose()
        return load

    load = asyncio.run(main())
    assert "rt-1" in load.accepted_ids
    assert load.num_waiting_tokens + load.kv.num_filled_slots >= len(prompt) + 5


def test_an_idle_engine_waits_for_held_back_spills_instead_of_stepping(tiny_llama):
    """A request done, its blocks' spills still held back by --kv-spill-gbps: the engine thread
    ran empty steps back to back until they all went out (a core at 100%, a TP group
    broadcasting empty plans); it now waits for the bound between them."""
    eng = AsyncLLMEngine(lambda: LLMEngine(EngineConfig(
        model=str(tiny_llama), block_size=4, num_kv_blocks=16, max_num_seqs=1,
        host_kv_blocks=64, kv_spill_gbps=1e-5)))
    try:
        counts = {"empty": 0}
        schedule = eng.engine.scheduler.schedule

        def counted():
            scheduled = schedule()
            counts["empty"] += not scheduled.plan.seqs
            return scheduled

        eng.engine.scheduler.schedule = counted
        asyncio.run(collect(eng, list(range(5, 45)), "r", max_tokens=4, temperature=0.0))
        assert eng.engine.scheduler.kv.tiers.pacer.num_pending > 0  # spills held back
        time.sleep(1.0)
        assert counts["empty"] < 200, counts
    finally:
        eng.shutdown()


@pytest.mark.parametrize("host_kv_blocks", [None, 64])
def test_a_report_lists_prefix_blocks_the_host_tier_holds(tiny_llama, host_kv_blocks):
    """A prefix the device pool evicted but its host tier holds is restored by a copy, not
    recomputed: the report must keep listing it, or the router sends the next turn of a
    conversation elsewhere to compute it all again. Without a host tier, it drops out."""
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=16,
                          host_kv_blocks=host_kv_blocks)
    eng = AsyncLLMEngine(lambda: LLMEngine(config))

    async def run(prompt, request_id):
        return await collect(eng, prompt, request_id, max_tokens=1, temperature=0.0)

    try:
        asyncio.run(run(list(range(100, 120)), "first"))
        first = set(eng._snapshot_load().cached_block_hashes)
        assert len(first) >= 4  # its full prompt blocks, cached on the device
        for i in range(4):  # each fills most of the pool: the first prompt's blocks are evicted
            asyncio.run(run([200 + i] * 56, f"filler{i}"))
        load = eng._snapshot_load()
        device = set(eng.engine.scheduler.kv.pool.cached_hashes(1 << 20))
    finally:
        eng.shutdown()
    assert not first & device
    if host_kv_blocks is None:
        assert not first & set(load.cached_block_hashes)
    else:
        assert first <= set(load.cached_block_hashes)
        # The device's blocks come first (most recently used first), then the host's.
        assert list(load.cached_block_hashes[:len(device)]) == \
            eng.engine.scheduler.kv.pool.cached_hashes(len(device))
