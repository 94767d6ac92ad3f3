"""Rank 0's tier bookkeeping at start: which disk blocks a warm start adopts, and tier sizing."""

import pytest

from kv.disk_index import write_snapshot
from workers.config import EngineConfig
from workers.tier_setup import RankTierConfig, build_kv_manager, tier_sizes

BLOCK = [1, 2, 3, 4]


def manager(tmp_path, records, tags):
    engine_dir = tmp_path / "engine0"
    write_snapshot(engine_dir / "rank0" / "tokens.snapshot", "disk-tokens", "model-a", records)
    config = EngineConfig(model="unused", block_size=4, host_kv_blocks=2,
                          disk_kv_dir=str(tmp_path), disk_kv_blocks=8)
    return build_kv_manager(config, 8, RankTierConfig(2, str(engine_dir), 8, "model-a"), tags)


def test_warm_start_adopts_blocks_every_rank_agrees_on(tmp_path):
    records = [[0, 11, BLOCK], [1, 12, BLOCK], [2, 13, BLOCK], [2, 14, BLOCK]]
    # slot 1: a rank holds another block there; slot 2 listed twice: kept once
    kv = manager(tmp_path, records, {0: 11, 1: 99, 2: 13})
    entries = kv.tiers.disk.entries
    assert sorted(entries) == [11, 13]
    assert entries[11].slot == 0 and entries[11].token_ids == tuple(BLOCK)
    assert kv.tiers.disk.num_used == 2  # their slots are not handed out again


def test_a_malformed_token_snapshot_is_ignored_with_a_warning(tmp_path, caplog):
    kv = manager(tmp_path, [[0, 11, BLOCK], [1, "x", BLOCK]], {0: 11, 1: 12})
    assert kv.tiers.disk.entries == {}
    assert "is not [slot, block hash, [token ids]]" in caplog.text


def test_tier_sizes_round_blocks_up_to_4_kib_slots():
    config = EngineConfig(model="unused", host_kv_gb=1.0, disk_kv_dir="/tmp/x", disk_kv_gb=2.0)
    host, disk = tier_sizes(config, bytes_per_block=5000)  # slots of 8192 bytes
    assert (host, disk) == ((1 << 30) // 8192, (2 << 30) // 8192)
    with pytest.raises(ValueError, match="holds no block"):
        tier_sizes(EngineConfig(model="unused", host_kv_gb=1e-9), bytes_per_block=5000)
