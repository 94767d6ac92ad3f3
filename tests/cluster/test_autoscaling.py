"""KV-load autoscaling policy: the pure sizing rule and the hysteresis of the Serve policy."""

from types import SimpleNamespace

from cluster.groups.autoscaling import KVLoadPolicy, desired_groups


def test_desired_groups_keeps_mean_usage_at_target():
    assert desired_groups([0.9, 0.9], 2, 1, 8, 0.7) == 3  # 1.8 / 0.7 = 2.57
    assert desired_groups([0.35, 0.35], 2, 1, 8, 0.7) == 1
    assert desired_groups([0.7, 0.7], 2, 1, 8, 0.7) == 2  # exactly at target: stay
    assert desired_groups([1.0] * 4, 4, 1, 5, 0.7) == 5  # capped at MAX
    assert desired_groups([0.0, 0.0], 2, 2, 5, 0.7) == 2  # floored at MIN
    assert desired_groups([], 3, 1, 5, 0.7) == 3  # no reports yet: keep


def ctx(usages, current, state=None):
    return SimpleNamespace(policy_state=state or {}, current_num_replicas=current,
                           aggregated_metrics={"kv_usage": dict(enumerate(usages))},
                           capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)


def test_policy_scales_up_at_once_and_down_after_a_streak():
    policy = KVLoadPolicy(target_occupancy=0.7, downscale_after=3)
    assert policy(ctx([0.95, 0.95], 2))[0] == 3
    state = {}
    decisions = []
    for _ in range(3):
        num, state = policy(ctx([0.1, 0.1, 0.1], 3, state))
        decisions.append(num)
    assert decisions == [3, 3, 1]
    num, state = policy(ctx([0.1, 0.1, 0.1], 3, {"low_streak": 2}))
    assert num == 1
    num, state = policy(ctx([0.9, 0.9, 0.9], 3, state))
    assert num == 4 and state["low_streak"] == 0  # load again: the streak starts over


def test_a_low_streak_keeps_asking_for_fewer_groups():
    """Serve scales down only after `downscale_delay_s` of the same decision: a policy that went
    back to the current count every third call would never let it (found by
    scripts/autoscale_demo.py, which stayed at 2 groups under a trickle)."""
    policy = KVLoadPolicy(target_occupancy=0.7, downscale_after=3)
    state = {}
    decisions = []
    for _ in range(8):
        num, state = policy(ctx([0.05, 0.05], 2, state))
        decisions.append(num)
    assert decisions == [2, 2, 1, 1, 1, 1, 1, 1]

