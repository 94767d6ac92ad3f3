"""The scheduler with a host tier, without a model: a request whose prefix is on host waits in
``loading`` while the others keep running, and starts after its blocks once the ranks agree the
copies finished; a failed copy makes it compute from that block on."""

import torch

from kv.eviction import HotnessPolicy, HotnessTracker, LRUPolicy
from kv.kv_manager import KVCacheManager
from kv.tiers.index import TierIndex
from kv.tiers.ops import OpStatus, Restore, Spill, TierOpResults
from kv.tiers.hierarchy import KVTiers
from workers.request import FinishReason, Request, RequestStatus
from workers.sampler import SampledToken
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig

BLOCK = 2


class Harness:
    """Steps the scheduler like the engine does; the ranks' transfers succeed unless told."""

    def __init__(self, num_blocks, host_blocks=16, tracker=None, hold_threshold=None):
        """LRU everywhere, or with ``tracker`` the hotness policy on every tier (the device's
        holding blocks above ``hold_threshold``)."""
        device_policy = HotnessPolicy(tracker, hold_threshold) if tracker is not None else None
        host_policy = HotnessPolicy(tracker, None) if tracker is not None else LRUPolicy()
        self.kv = KVCacheManager(num_blocks, BLOCK, policy=device_policy, tracker=tracker)
        self.kv.tiers = KVTiers(self.kv.pool, BLOCK, TierIndex("host", host_blocks, host_policy))
        self.scheduler = Scheduler(SchedulerConfig(64, 4), self.kv)
        self.num_requests = 0

    def add(self, prompt):
        request = Request(f"r{self.num_requests}", self.num_requests, list(prompt),
                          SamplingParams(max_tokens=4), torch.Generator())
        self.num_requests += 1
        self.scheduler.add(request)
        return request

    def run_transfers_first(self):
        """Give the scheduler the engine's hook (every op it is handed succeeds); returns the
        list of the op tuples it was handed."""
        ran = []

        def run_transfers(ops):
            ran.append(ops)
            return TierOpResults(self.kv.tiers.num_committed, (OpStatus.OK,) * len(ops))

        self.scheduler.run_transfers = run_transfers
        return ran

    def send_to_host(self, prompt, num_filler_tokens):
        """Run ``prompt`` and finish it (its full blocks are written through to host), then a
        request of ``num_filler_tokens`` that fills the pool and evicts them from the device."""
        for tokens in (list(prompt), list(range(20, 20 + num_filler_tokens))):
            request = self.add(tokens)
            self.step()
            self.scheduler.finish(request, FinishReason.STOP)
            self.step()

    def step(self):
        step = self.scheduler.schedule()
        tiers = self.kv.tiers
        results = None
        if tiers.has_outstanding:
            first = tiers.num_committed
            results = TierOpResults(first, (OpStatus.OK,) * (tiers.num_issued - first))
        self.scheduler.update(step, results)
        for request, _ in step.scheduled:
            if request.status == RequestStatus.RUNNING and \
                    request.num_computed_tokens == request.num_tokens:
                request.append_token(SampledToken(3))
        return step


def test_a_request_restoring_from_host_waits_while_others_run():
    h = Harness(num_blocks=8)
    a = h.add([10, 11, 12, 13, 14, 15])
    h.step()
    h.scheduler.finish(a, FinishReason.STOP)  # its 3 full blocks are written through to host
    spills = h.step().plan.tier_ops
    assert [type(op) for op in spills] == [Spill] * 3
    d = h.add(list(range(20, 36)))  # 8 blocks: evicts a's blocks from the device
    h.step()
    h.scheduler.finish(d, FinishReason.STOP)
    h.step()
    c = h.add([40, 41, 42])
    h.step()
    assert c.status == RequestStatus.RUNNING
    b = h.add([10, 11, 12, 13, 14, 15, 16, 17])  # a's prefix: only on host now

    step = h.step()
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 6  # restored
    assert [type(op) for op in step.plan.tier_ops].count(Restore) == 3
    assert [s.seq_id for s in step.plan.seqs] == [c.seq_id]  # c ran; b waited for its blocks
    assert h.kv.tiers.host.num_hits == 3

    step = h.step()
    assert {s.seq_id for s in step.plan.seqs} == {b.seq_id, c.seq_id}
    b_step = next(s for s in step.plan.seqs if s.seq_id == b.seq_id)
    assert b_step.num_computed == 6 and b_step.token_ids == (16, 17)


def test_a_failed_restore_truncates_the_prefix_and_drops_the_rest():
    h = Harness(num_blocks=6)
    a = h.add([10, 11, 12, 13, 14, 15])
    h.step()
    h.scheduler.finish(a, FinishReason.STOP)
    h.step()
    d = h.add(list(range(20, 32)))  # 6 blocks: evicts a's
    h.step()
    h.scheduler.finish(d, FinishReason.STOP)
    b = h.add([10, 11, 12, 13, 14, 15, 16])
    step = h.scheduler.schedule()  # d's spills, then b's three restores
    ops = step.plan.tier_ops
    restores = [op for op in ops if isinstance(op, Restore)]
    assert len(restores) == 3 and b.status == RequestStatus.LOADING
    tiers = h.kv.tiers
    statuses = [OpStatus.OK] * len(ops)
    statuses[ops.index(restores[1])] = OpStatus.CHECKSUM  # the ranks: the 2nd block is corrupt
    h.scheduler.update(step, TierOpResults(tiers.num_committed, tuple(statuses)))
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 2  # first block only
    assert tiers.stats.num_checksum_failures == 1
    # the corrupt block and its descendant left the host tier; the block before it stays
    assert restores[0].tag in tiers.host.entries
    assert restores[1].tag not in tiers.host.entries and restores[2].tag not in tiers.host.entries
    assert h.scheduler.schedule().plan.seqs[0].num_computed == 2  # computes from block 2 on


def test_ranks_wait_for_spills_only_when_the_step_writes_a_block_being_spilled():
    for new_prompts, expect_wait in (([[30, 31, 32]], False),  # fits in empty blocks
                                     ([[30, 31, 32], [40, 41, 42, 43, 44]], True)):  # reuses a's
        h = Harness(num_blocks=6)
        a = h.add([10, 11, 12, 13, 14, 15])
        h.step()
        h.scheduler.finish(a, FinishReason.STOP)  # three spills issued, not yet run
        for prompt in new_prompts:
            h.add(prompt)
        step = h.scheduler.schedule()
        assert [type(op) for op in step.plan.tier_ops] == [Spill] * 3
        assert step.plan.wait_spill_reads is expect_wait


def test_preempting_into_a_host_tier_of_private_slots_skips_write_through():
    """The preempted request's tail takes the only host slot; its full block then has nowhere to
    go: write-through skips it (counted) instead of raising, and the request still resumes."""
    h = Harness(num_blocks=4, host_blocks=1)
    x = h.add([1, 2, 3])
    y = h.add([4, 5])
    h.step()  # x: 3 tokens in 2 blocks, y: 2 tokens in 1 block
    h.step()  # x: 4 tokens, y: 3 tokens: the pool is full
    step = h.step()  # x needs a third block: y is preempted with 3 tokens, 1 in a partial block
    assert y.status == RequestStatus.WAITING and y.swapped_tail is not None
    tiers = h.kv.tiers
    assert tiers.stats.num_swapped_out == 1 and not tiers.host.can_take()
    assert tiers.stats.num_spills_skipped == 1  # y's full block (4, 5): no slot to take
    assert [type(op) for op in step.plan.tier_ops] == [Spill]  # the tail's swap-out only
    assert tiers.usage()["spills_skipped_total"] == 1
    h.scheduler.finish(x, FinishReason.STOP)
    # y's full block is still cached on the device, so its tail comes back from its slot; x's
    # full blocks are spilled behind that copy, into the slot it frees (read first: in order).
    step = h.step()
    assert [type(op) for op in step.plan.tier_ops] == [Restore, Spill, Spill]
    assert tiers.stats.num_spills_skipped == 1
    assert y.status == RequestStatus.RUNNING and y.num_computed_tokens == 3
    assert tiers.stats.num_swapped_in == 1
    assert y.swapped_tail is None and tiers.host.can_take()  # the private slot came back


def test_a_hot_block_evicted_as_a_last_resort_is_found_on_host():
    """A block held on the device by its hotness is still evicted when nothing else is free; its
    prefix must then come back from host, not be recomputed."""
    # Scores: 0.1 after one use, 0.19 after two in a row, 0.171 one request later: held at 0.15.
    h = Harness(num_blocks=4, tracker=HotnessTracker(decay=0.9), hold_threshold=0.15)
    a1 = h.add([10, 11, 12])
    h.step()
    a2 = h.add([10, 11, 12])  # shares block (10, 11)
    h.step()
    hot = h.kv.blocks(a1.request_id)[0].block_hash
    assert h.kv.pool.policy.is_held(hot)
    h.scheduler.finish(a1, FinishReason.STOP)
    h.scheduler.finish(a2, FinishReason.STOP)  # the hot block is released here
    h.step()
    b = h.add(list(range(20, 28)))  # needs all 4 blocks: evicts the hot one too
    h.step()
    assert h.kv.pool.num_held_evicted == 1 and h.kv.pool.lookup(hot, (10, 11)) is None
    h.scheduler.finish(b, FinishReason.STOP)
    c = h.add([10, 11, 12, 13, 14])

    step = h.step()
    assert [op.tag for op in step.plan.tier_ops if isinstance(op, Restore)] == [hot]
    assert h.kv.tiers.host.num_hits == 1
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 2  # restored


def test_with_the_engines_hook_a_restored_request_computes_in_the_step_that_restores_it():
    """The hook runs the step's transfers first (every one succeeds here): b's prefix comes back
    from host and b computes its two new tokens in that same step, beside c."""
    h = Harness(num_blocks=8)
    ran = h.run_transfers_first()
    h.send_to_host([10, 11, 12, 13, 14, 15], num_filler_tokens=16)
    c = h.add([40, 41, 42])
    h.step()
    b = h.add([10, 11, 12, 13, 14, 15, 16, 17])  # the first prompt's blocks: only on host now
    ran.clear()
    step = h.step()
    assert [type(op) for op in ran[0]].count(Restore) == 3
    assert step.plan.tier_ops == ()  # already run
    assert {s.seq_id for s in step.plan.seqs} == {b.seq_id, c.seq_id}
    b_step = next(s for s in step.plan.seqs if s.seq_id == b.seq_id)
    assert b_step.num_computed == 6 and b_step.token_ids == (16, 17)
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 8


def test_a_step_that_restores_waits_for_its_restores_only_not_the_spills_of_released_blocks():
    """Blocks released the step before are spilled behind the restores and run with the step's
    compute: the ranks wait for b's restores alone (the issue's "a step never waits for a spill
    that no scheduled request needs")."""
    h = Harness(num_blocks=10)
    ran = h.run_transfers_first()
    h.send_to_host([10, 11, 12, 13, 14, 15], num_filler_tokens=20)
    c = h.add([40, 41, 42])
    e = h.add([50, 51, 52, 53, 54, 55])
    h.step()
    h.scheduler.finish(e, FinishReason.STOP)  # its 3 full blocks go down to host
    b = h.add([10, 11, 12, 13, 14, 15, 16, 17])  # the first prompt's blocks: only on host now
    ran.clear()
    step = h.step()
    assert [type(op) for op in ran[0]] == [Restore] * 3
    assert [type(op) for op in step.plan.tier_ops] == [Spill] * 3  # queued behind, not waited
    assert {s.seq_id for s in step.plan.seqs} == {b.seq_id, c.seq_id}
    assert b.num_computed_tokens == 8


def test_cached_hashes_list_the_pools_then_only_the_hosts_up_to_the_limit():
    """What a group reports as cached: the pool's hashes first, then the host tier's that the
    pool no longer holds (write-through puts the pool's own blocks on host too: listed once)."""
    h = Harness(num_blocks=4)
    h.send_to_host([10, 11, 12, 13, 14], num_filler_tokens=7)  # 2 blocks, then 3 of filler
    kv = h.kv
    device = kv.pool.cached_hashes(100)
    host_only = [x for x in kv.tiers.host.recent_hashes() if x not in device]
    assert len(host_only) == 2 and len(device) >= 1  # the first prompt's blocks: host only
    listed = kv.cached_hashes(100)
    assert listed == device + host_only and len(set(listed)) == len(listed)
    assert kv.cached_hashes(len(device) + 1) == device + host_only[:1]
    assert kv.cached_hashes(1) == device[:1]
    kv.tiers = None
    assert kv.cached_hashes(100) == device
