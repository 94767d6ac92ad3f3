"""A group's report of what its scheduler has yet to compute without a KV block, walked at a
bounded cost per report."""

import pytest

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams
from workers.waiting_demand import WaitingDemand

HISTORY = [7] * 40  # 10 blocks of 4


def test_a_report_counts_the_rest_of_a_prompt_being_prefilled_in_chunks(tiny_llama):
    """A running request mid-prefill holds blocks only for the chunks it has computed; the rest
    of its prompt takes blocks in the next steps, so a report must count it, or the router sees
    room that is already spoken for."""
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                          max_num_batched_tokens=16)
    demand = WaitingDemand()
    with LLMEngine(config) as sync:
        sync.add_request([7] * 100, SamplingParams(max_tokens=2), "long")
        sync.add_request([8] * 10, SamplingParams(max_tokens=2), "queued")
        assert demand.uncomputed_tokens(sync.scheduler) == 110
        sync.step()  # the first 16-token chunk of "long"; "queued" still waits
        assert [r.request_id for r in sync.scheduler.running] == ["long"]
        assert sync.scheduler.kv_usage().num_filled_slots == 16
        assert demand.uncomputed_tokens(sync.scheduler) == 84 + 10


def _turns_waiting_behind_another(tiny_llama, num_turns: int) -> LLMEngine:
    """An engine running one sequence at a time: the history computed and cached, another
    request running, and ``num_turns`` next turns (the history + 6 tokens each) waiting."""
    config = EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                          max_num_seqs=1)
    sync = LLMEngine(config)
    sync.add_request(HISTORY, SamplingParams(max_tokens=1), "turn1")
    while sync.has_unfinished():
        sync.step()
    sync.add_request([9] * 8, SamplingParams(max_tokens=4), "other")
    sync.step()
    for k in range(num_turns):
        sync.add_request(HISTORY + [8 + k] * 6, SamplingParams(max_tokens=2), f"next{k}")
    return sync


def test_a_waiting_request_counts_only_what_its_cached_prefix_does_not_hold(tiny_llama):
    """A conversation's next turn waiting behind others needs blocks only past its history's
    cached blocks (the router charges it so too). Counting its whole prompt made a busy group's
    report say its pool was past full while the turns queued there needed a few blocks each:
    the router then sent the next turn away from its history (serving benchmark at 3.5 req/s,
    docs/history.md#serve-r35-versions: 17 decisions and 1,102 cached blocks given up in 800
    requests)."""
    with _turns_waiting_behind_another(tiny_llama, 1) as sync:
        assert [r.request_id for r in sync.scheduler.waiting] == ["next0"]
        # 46 tokens in 12 blocks of 4, the first 10 cached (the history's 40 tokens): 6 to compute
        assert WaitingDemand().uncomputed_tokens(sync.scheduler) == 6


class _CountedLookups:
    def __init__(self, pool):
        self.pool, self.calls, self._lookup = pool, 0, pool.lookup
        pool.lookup = self

    def __call__(self, *args):
        self.calls += 1
        return self._lookup(*args)


def test_a_report_walks_at_most_its_budget_and_later_reports_go_on_from_there(tiny_llama):
    """A full prefix lookup of every waiting request in every report (taken after each engine
    step) cost 8.8-10.5 ms with 256 requests of 2,048 tokens waiting (scripts/bench_load_report.py):
    up to a third of a GPU decode step. Here three next turns of 10 cached blocks each would take 33
    lookups per report; with a budget of 12, each report takes at most 12, counting a request
    it has not finished walking as if less were cached. The first report walks the first turn
    (11 lookups) and one block of the second; the second report goes on there, then walks two
    blocks of the third; the third report is exact."""
    with _turns_waiting_behind_another(tiny_llama, 3) as sync:
        lookups = _CountedLookups(sync.scheduler.kv.pool)
        demand, reports = WaitingDemand(max_lookups=12), []
        for _ in range(4):
            lookups.calls = 0
            reports.append(demand.uncomputed_tokens(sync.scheduler))
            assert lookups.calls <= 12
        assert reports == [6 + 42 + 46, 6 + 6 + 38, 18, 18]
        assert WaitingDemand(max_lookups=10**6).uncomputed_tokens(sync.scheduler) == 18


def test_every_waiting_request_gets_its_walk_when_the_queue_outgrows_the_budget(tiny_llama):
    """Walked from the front of the queue in every report, the requests whose walks were done
    took one lookup each (does the prefix go on?) before any other's walk went on: with more
    waiting requests than the budget's blocks, those at the back were never walked. Here a
    budget of 2 and three next turns: the third stayed at its whole prompt (58 tokens, not 18)
    however many reports came. Each report now starts where the last one's budget ran out."""
    with _turns_waiting_behind_another(tiny_llama, 3) as sync:
        demand = WaitingDemand(max_lookups=2)
        reports = [demand.uncomputed_tokens(sync.scheduler) for _ in range(40)]
        assert reports[-1] == 18
        assert reports == sorted(reports, reverse=True)  # never under the exact figure on the way


def test_after_an_eviction_a_walk_starts_over(tiny_llama):
    """The blocks a walk found stay cached only until the pool evicts: then each request's walk
    starts again from its first block, so evicted histories count again."""
    with _turns_waiting_behind_another(tiny_llama, 3) as sync:
        demand = WaitingDemand(max_lookups=100)
        assert demand.uncomputed_tokens(sync.scheduler) == 18
        pool = sync.scheduler.kv.pool
        pool.free(pool.allocate(pool.num_free))  # takes every free block: the history goes
        assert pool.num_evicted >= 10
        assert demand.uncomputed_tokens(sync.scheduler) == 3 * 46


def test_a_budget_under_one_block_is_refused_by_name():
    with pytest.raises(ValueError, match="max_lookups must be at least 1, got 0"):
        WaitingDemand(max_lookups=0)
