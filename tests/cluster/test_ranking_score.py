"""The weighted score that orders the groups under target: prefix against load (relative to the
busiest group), and its settings refused by name. The helpers and the policy's other rules are
in test_ranking.py."""

from __future__ import annotations

import pytest

from cluster.routing.ranking import rank_groups
from kv.prefix_hash import extend_block_hashes

from test_ranking import BS, R, demand, ids, load


@pytest.mark.parametrize("load_weight, expected", [
    # the strict order: the longest cached prefix first, load only breaking ties
    (0.0, [("six_blocks", R.UNDER_TARGET_PREFIX, 6), ("two_blocks", R.UNDER_TARGET_PREFIX, 2),
           ("empty", R.UNDER_TARGET, 0)]),
    # 12 blocks: occupancies 0.12, 0.42, 0.62 (the highest under target). Scores, 3 x prefix
    # fraction + 2 x (1 - occupancy / 0.62): six 2.25 + 0, empty 0 + 1.61, two 0.75 + 0.65.
    (2.0, [("six_blocks", R.UNDER_TARGET_PREFIX, 6), ("empty", R.UNDER_TARGET, 0),
           ("two_blocks", R.UNDER_TARGET_PREFIX, 2)]),
])
def test_the_load_weight_trades_a_short_prefix_for_load(load_weight, expected):
    tokens = list(range(8 * BS))
    hashes = extend_block_hashes([], tokens, BS)
    loads = [
        load("empty", 0),
        load("two_blocks", 30, cached=hashes[:2]),
        load("six_blocks", 50, cached=hashes[:6] + [12345]),
    ]
    ranked = rank_groups(demand(len(tokens) + 64, hashes), loads, load_weight=load_weight)
    assert [(p.group_id, p.reason, p.cached_prefix_blocks) for p in ranked] == expected


def test_a_shared_system_prompt_does_not_pull_every_request_to_one_group():
    # Every prompt starts with the same 2 blocks; "warm" cached them with its first request and
    # is busier (occupancy with the request 0.38 against 0.08). The strict order sends the next
    # request there too; the score sends it to the idle group (3 x 2/8 = 0.75 against
    # 2 x (1 - 0.08 / 0.38) = 1.58), but keeps a conversation's next turn (7 of 8 blocks
    # cached: 2.63) where its prefix is.
    system = list(range(2 * BS))
    new_request = extend_block_hashes([], system + list(range(500, 500 + 6 * BS)), BS)
    next_turn = extend_block_hashes([], system + list(range(900, 900 + 6 * BS)), BS)
    warm = load("warm", 30, cached=new_request[:2] + next_turn[:7])
    idle = load("idle", 0)
    strict = rank_groups(demand(8 * BS, new_request), [warm, idle], load_weight=0.0)
    assert ids(strict) == ["warm", "idle"]
    assert ids(rank_groups(demand(8 * BS, new_request), [warm, idle])) == ["idle", "warm"]
    assert ids(rank_groups(demand(8 * BS, next_turn), [warm, idle])) == ["warm", "idle"]


def test_a_next_turn_stays_with_its_history_when_every_group_holds_the_system_prompt():
    # Both groups hold the shared 8-block system prompt; "home" also holds the conversation's
    # 9 blocks of history and is busy (projected occupancy 0.61 against 0.10). Over the whole
    # request the prefix score gives home 3 x 17/17 = 3 and "idle" 3 x 8/17 = 1.41 + load
    # 2 x (1 - 0.10 / 0.61) = 1.67, so 3.08, and the turn would lose its history for load. The
    # system prompt tells the groups apart in nothing: over the other 9 blocks home scores
    # 3 x 9/9 = 3 and idle 0 + 1.67.
    system = list(range(8 * BS))
    history = list(range(1000, 1000 + 9 * BS))
    turn = extend_block_hashes([], system + history, BS)
    home = load("home", 60, cached=turn)
    idle = load("idle", 0, cached=turn[:8])
    ranked = rank_groups(demand(17 * BS + 8, turn), [home, idle])
    assert [(p.group_id, p.cached_prefix_blocks) for p in ranked] == [("home", 17),
                                                                          ("idle", 8)]
    # A new conversation (the system prompt only) goes by load alone.
    new = extend_block_hashes([], system + list(range(5000, 5000 + 9 * BS)), BS)
    assert ids(rank_groups(demand(17 * BS + 8, new), [home, idle])) == ["idle", "home"]


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="must not be negative"):
        rank_groups(demand(BS), [load("a", 0)], load_weight=-1.0)


def test_a_conversations_group_is_placed_by_its_score_among_the_base_groups():
    # Every group holds the 4-block system prompt; "b" also the conversation's next 4 blocks.
    loads = [load("a", 10), load("b", 20), load("c", 5), load("d", 80)]
    cached = {"a": 4, "b": 8, "c": 4, "d": 4}
    ranked = rank_groups(demand(10 * BS, tuple(range(10))), loads, cached_prefix=cached)
    assert ids(ranked) == ["b", "c", "a", "d"]
