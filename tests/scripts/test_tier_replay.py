"""scripts/tiers/replay.py: which requests a replay adds when (closed and open loop), and that an
open-loop TTFT counts the time a request waited for the engine."""

from __future__ import annotations

import pytest

from bench_scripts import load_script


@pytest.fixture(scope="module")
def replay_module():
    load_script("bench_kv_tiers")  # puts scripts/ on the path
    from scripts.tiers import replay as tier_replay
    return tier_replay


def test_closed_loop_adds_while_fewer_than_max_in_flight_run(replay_module):
    due = replay_module._Due(5, None, max_in_flight=2)
    assert due.take(0.0) == [0, 1] and due.take(0.0) == []
    due.num_running -= 1  # one finished
    assert due.take(9.0) == [2]
    due.num_running -= 2
    assert due.take(9.0) == [3, 4] and not due.pending


def test_open_loop_adds_what_has_arrived_whatever_runs(replay_module):
    due = replay_module._Due(4, [0.0, 0.5, 0.5, 2.0], max_in_flight=1)
    assert due.take(0.1) == [0]
    assert due.next_arrival() == 0.5
    assert due.take(0.6) == [1, 2]  # more than max_in_flight: the engine queues them
    assert due.take(1.9) == [] and due.take(2.0) == [3]


def test_arrival_times_must_match_the_requests(replay_module):
    with pytest.raises(ValueError, match="3 arrival times for 2 requests"):
        replay_module._Due(2, [0.0, 1.0, 2.0], max_in_flight=1)


@pytest.mark.slow
def test_open_loop_ttft_includes_the_wait_for_the_engine(replay_module, tiny_llama):
    """Six requests arriving at once to an engine that runs one at a time: in the open loop the
    k-th waits for k - 1 others, so its TTFT grows with k; in the closed loop each is added when
    the one before finishes and its TTFT is its own prefill."""
    from workers.config import EngineConfig
    config = EngineConfig(model=str(tiny_llama), block_size=16, num_kv_blocks=64,
                          max_num_seqs=1, device="cpu")
    prompts = [[5 + (7 * i + j) % 200 for j in range(48)] for i in range(6)]
    outputs = [8] * 6
    closed = replay_module.replay("device_only", config, prompts, outputs, 256)
    opened = replay_module.replay("device_only", config, prompts, outputs, 256, [0.0] * 6)
    assert len(opened.ttft_s) == len(closed.ttft_s) == 6
    assert opened.ttft_ms() > 2 * closed.ttft_ms()


@pytest.mark.slow
def test_between_arrivals_a_spill_bound_is_waited_for_not_stepped(replay_module, tiny_llama,
                                                                  monkeypatch):
    """With --kv-spill-gbps, spills held back by the bound keep the engine unfinished after a
    request is done. Before, the replay ran empty steps back to back until the next arrival
    (and the last spill): a core at 100% inside the benchmark that measures the tiers."""
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    steps = []

    class CountingEngine(LLMEngine):
        def step(self):
            steps.append(1)
            return super().step()

    monkeypatch.setattr(replay_module, "LLMEngine", CountingEngine)
    config = EngineConfig(model=str(tiny_llama), block_size=16, num_kv_blocks=64,
                          max_num_seqs=2, device="cpu", host_kv_blocks=64, kv_spill_gbps=1e-5)
    prompts = [[5 + (7 * i + j) % 200 for j in range(48)] for i in range(2)]
    result = replay_module.replay("host", config, prompts, [4, 4], 256, [0.0, 1.5])
    assert len(result.ttft_s) == 2
    assert len(steps) < 300, len(steps)
