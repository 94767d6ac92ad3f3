"""Eviction policies: LRU order, hotness scores and decay, holding hot keys, a shared tracker, and
the heap against a brute-force model under random operations."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from kv.eviction import HotnessPolicy, HotnessTracker, LRUPolicy, make_policy

DECAY = 0.95


def drain(policy):
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
        policy.remove(key)
    return order


def test_lru_evicts_least_recently_inserted_or_accessed():
    lru = LRUPolicy()
    for key in (1, 2, 3, 4):
        lru.insert(key)
    lru.record_access(2)
    lru.record_access(1)
    lru.record_access(99)  # not present: ignored
    assert lru.victim() == 3
    assert lru.victim() == 3  # victim() does not remove
    assert drain(lru) == [3, 4, 2, 1]
    assert lru.victim() is None
    assert not lru.is_held(1)


@pytest.mark.parametrize("make", [LRUPolicy, lambda: HotnessPolicy(HotnessTracker())])
def test_insert_remove_discard_contains_len(make):
    policy = make()
    policy.insert(1)
    policy.insert(2)
    assert 1 in policy and 3 not in policy and len(policy) == 2
    with pytest.raises(ValueError, match="already evictable"):
        policy.insert(1)
    policy.remove(1)
    assert 1 not in policy and len(policy) == 1
    with pytest.raises(KeyError):
        policy.remove(1)
    policy.discard(1)  # absent: no error
    policy.discard(2)
    assert len(policy) == 0 and policy.victim() is None
    policy.insert(1)  # a removed key can come back
    assert policy.victim() == 1


def test_tracker_scores_follow_the_formula():
    tracker = HotnessTracker(DECAY)
    assert tracker.score(7) == 0.0 and tracker.priority(7) == -math.inf
    tracker.access(7)
    tracker.access(7)  # at most once per tick
    assert tracker.score(7) == pytest.approx(1 - DECAY)
    for _ in range(3):
        tracker.tick()
    assert tracker.score(7) == pytest.approx((1 - DECAY) * DECAY**3)
    tracker.access(7)
    assert tracker.score(7) == pytest.approx((1 - DECAY) * DECAY**3 + (1 - DECAY))
    assert len(tracker) == 1
    tracker.forget(7)
    assert tracker.score(7) == 0.0 and len(tracker) == 0


def test_priority_orders_like_current_score_and_only_grows_on_access():
    tracker = HotnessTracker(DECAY)
    tracker.access("a")
    tracker.tick()
    tracker.access("b")
    before = tracker.priority("a")
    for _ in range(50):
        tracker.tick()
        assert tracker.priority("a") == before  # time-invariant
        assert (tracker.priority("a") < tracker.priority("b")) == (tracker.score("a") < tracker.score("b"))
    tracker.access("a")
    assert tracker.priority("a") > before


def test_key_used_on_many_ticks_outlives_keys_used_once():
    tracker = HotnessTracker(DECAY)
    policy = HotnessPolicy(tracker)
    for key in (1, 2, 3):
        policy.insert(key)
    for _ in range(5):
        policy.record_access(2)
        tracker.tick()
    policy.record_access(1)
    policy.record_access(3)
    # 1 and 3 have the same score: the earlier insert goes first.
    assert drain(policy) == [1, 3, 2]


def test_ties_go_to_the_earlier_insert_whatever_the_access_order():
    tracker = HotnessTracker(DECAY)
    policy = HotnessPolicy(tracker)
    for key in (1, 2, 3):
        policy.insert(key)
    for key in (3, 2, 1):
        policy.record_access(key)
    assert drain(policy) == [1, 2, 3]


def test_old_hot_key_decays_below_a_recent_one():
    tracker = HotnessTracker(DECAY)
    policy = HotnessPolicy(tracker)
    policy.insert("old")
    policy.insert("new")
    for _ in range(10):
        policy.record_access("old")
        tracker.tick()
    old_score = 1 - DECAY**10  # ten consecutive uses, read one tick later below
    assert tracker.score("old") == pytest.approx(old_score * DECAY)
    assert policy.victim() == "new"  # never used: score 0
    # After k idle ticks old = old_score * DECAY**k; one use of "new" now scores 1 - DECAY.
    k = math.ceil(math.log((1 - DECAY) / old_score) / math.log(DECAY))
    for _ in range(k - 1):
        tracker.tick()
    policy.record_access("new")
    assert tracker.score("old") == pytest.approx(old_score * DECAY**k)
    assert tracker.score("old") < tracker.score("new") == pytest.approx(1 - DECAY)
    assert policy.victim() == "old"


def test_held_after_enough_consecutive_uses_and_still_evicted_last():
    # After n consecutive uses the score is 1 - 0.95**n; it exceeds 0.9 first at n = 45.
    n = math.ceil(math.log(0.1) / math.log(DECAY))
    assert n == 45
    tracker = HotnessTracker(DECAY)
    policy = HotnessPolicy(tracker, hold_threshold=0.9)
    policy.insert("prompt")
    policy.insert("cold")
    for i in range(n):
        assert not policy.is_held("prompt")
        policy.record_access("prompt")
        if i < n - 1:
            tracker.tick()
    assert tracker.score("prompt") == pytest.approx(1 - DECAY**n)
    assert policy.is_held("prompt") and not policy.is_held("cold")
    assert policy.victim() == "cold"
    policy.remove("cold")
    assert policy.victim() == "prompt"  # only held keys remain: still evictable
    assert not HotnessPolicy(tracker, hold_threshold=None).is_held("prompt")


def test_shared_tracker_keeps_the_score_across_tiers():
    tracker = HotnessTracker(DECAY)
    device, host = HotnessPolicy(tracker), HotnessPolicy(tracker)
    device.insert(1)
    device.insert(2)
    host.insert(3)
    for _ in range(3):
        device.record_access(1)
        tracker.tick()
    host.record_access(3)
    score = tracker.score(1)
    device.remove(1)
    host.insert(1)
    assert tracker.score(1) == score
    assert host.victim() == 3  # 1 kept its three uses
    # An access recorded through another policy still reorders this one.
    for _ in range(5):
        device.record_access(3)
        tracker.tick()
    assert host.victim() == 1
    assert device.victim() == 2


def test_heap_stays_bounded_under_repeated_access():
    tracker = HotnessTracker(DECAY)
    policy = HotnessPolicy(tracker)
    for key in range(4):
        policy.insert(key)
    for _ in range(1000):
        for key in range(4):
            policy.record_access(key)
        tracker.tick()
    assert len(policy._heap) <= 2 * len(policy) + 16
    assert drain(policy) == [0, 1, 2, 3]


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5, float("nan")])
def test_bad_decay(decay):
    with pytest.raises(ValueError, match="decay"):
        HotnessTracker(decay)


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.01, float("nan")])
def test_bad_hold_threshold(threshold):
    with pytest.raises(ValueError, match="hold_threshold"):
        HotnessPolicy(HotnessTracker(), threshold)


def test_make_policy():
    tracker = HotnessTracker()
    assert isinstance(make_policy("lru", None, None), LRUPolicy)
    policy = make_policy("hotness", tracker, 0.8)
    assert isinstance(policy, HotnessPolicy) and policy.tracker is tracker and policy.hold_threshold == 0.8
    with pytest.raises(ValueError, match="needs a HotnessTracker"):
        make_policy("hotness", None, 0.9)
    with pytest.raises(ValueError, match="--kv-eviction must be lru or hotness, got 'lfu'"):
        make_policy("lfu", tracker, 0.9)


KEYS = st.integers(0, 4)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), KEYS),
        st.tuples(st.just("remove"), KEYS),
        st.tuples(st.just("access"), KEYS),
        st.tuples(st.just("access_other"), KEYS),
        st.tuples(st.just("tick"), st.just(0)),
        st.tuples(st.just("evict"), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, decay=st.sampled_from([0.5, 0.9, 0.95]))
def test_hotness_matches_brute_force_model(ops, decay):
    tracker = HotnessTracker(decay)
    policy, other = HotnessPolicy(tracker), HotnessPolicy(tracker)
    scores, used_this_tick, present = {}, set(), []  # the model; present in insertion order
    for op, key in ops:
        if op == "insert" and key not in present:
            policy.insert(key)
            present.append(key)
        elif op == "remove" and key in present:
            policy.remove(key)
            present.remove(key)
        elif op in ("access", "access_other"):
            (policy if op == "access" else other).record_access(key)
            if key not in used_this_tick:
                scores[key] = scores.get(key, 0.0) + (1 - decay)
                used_this_tick.add(key)
        elif op == "tick":
            tracker.tick()
            scores = {k: s * decay for k, s in scores.items()}
            used_this_tick.clear()
        elif op == "evict" and present:
            victim = policy.victim()
            policy.remove(victim)
            present.remove(victim)

        assert len(policy) == len(present) and all(k in policy for k in present)
        for k, s in scores.items():
            assert tracker.score(k) == pytest.approx(s, rel=1e-9, abs=1e-300)
        victim = policy.victim()
        if not present:
            assert victim is None
            continue
        assert victim in present
        assert scores.get(victim, 0.0) == pytest.approx(min(scores.get(k, 0.0) for k in present), rel=1e-9)
        # Exact tie-break: among keys with the lowest (exact) priority, the earliest inserted.
        lowest = min(tracker.priority(k) for k in present)
        assert victim == next(k for k in present if tracker.priority(k) == lowest)


def test_tracker_prunes_keys_unused_for_long():
    tracker = HotnessTracker(0.5, prune_every=64)
    tracker.access("old")
    for _ in range(63):
        tracker.tick()
    tracker.access("recent")
    tracker.tick()  # tick 64: "old" decayed to 0.5 * 0.5**64, below the threshold
    assert len(tracker) == 1
    assert tracker.score("old") == 0.0 and tracker.score("recent") == pytest.approx(0.25)
