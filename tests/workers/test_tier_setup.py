"""Rank 0's tier bookkeeping at start: which disk blocks a warm start adopts, tier sizing, the
list of disk directories and the engine's claim on them."""

import pytest

from kv.tiers.disk.index import lock_directory, write_snapshot
from workers.config import EngineConfig
from workers.tier_setup import RankTierConfig, build_kv_manager, claim_engine_dir, tier_sizes

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


@pytest.mark.parametrize("value,words", [
    ("a,,b", "entry 2 is empty"),
    ("a,b,", "entry 3 is empty"),
    ("/kv/a,/kv/b/../a", "'/kv/b/../a' is the same directory as '/kv/a'"),
])
def test_a_bad_disk_dir_list_is_refused_by_name(value, words):
    with pytest.raises(ValueError, match="--disk-kv-dir") as info:
        EngineConfig(model="unused", host_kv_blocks=2, disk_kv_dir=value, disk_kv_blocks=8)
    assert words in str(info.value)


def test_a_symlink_to_a_listed_directory_is_a_duplicate(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match="is the same directory as"):
        EngineConfig(model="unused", host_kv_blocks=2, disk_kv_blocks=8,
                     disk_kv_dir=f"{tmp_path / 'a'},{tmp_path / 'link'}")


def test_disk_dirs_parse_in_order():
    config = EngineConfig(model="unused", host_kv_blocks=2, disk_kv_dir=" /x , /y,/z",
                          disk_kv_blocks=8)
    assert config.disk_kv_dirs == ("/x", "/y", "/z")
    assert EngineConfig(model="unused").disk_kv_dirs == ()


def test_a_directory_that_cannot_be_created_is_refused_by_name(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    bad = str(tmp_path / "file" / "kv")
    with pytest.raises(ValueError, match=f"--disk-kv-dir entry '{bad}' cannot be created"):
        claim_engine_dir([str(tmp_path / "good"), bad])


def test_too_few_blocks_for_the_directories_is_refused():
    config = EngineConfig(model="unused", host_kv_blocks=2, disk_kv_dir="/a,/b,/c",
                          disk_kv_blocks=2)
    with pytest.raises(ValueError, match="fewer than the 3 directories of --disk-kv-dir"):
        tier_sizes(config, bytes_per_block=4096)


def test_an_engine_claims_the_same_index_in_every_directory(tmp_path):
    dirs = [str(tmp_path / name) for name in ("a", "b", "c")]
    held = lock_directory(tmp_path / "b" / "engine0")  # another engine holds b/engine0 only
    paths, locks = claim_engine_dir(dirs)
    assert paths == [tmp_path / name / "engine1" for name in ("a", "b", "c")]
    second, second_locks = claim_engine_dir(dirs)  # a/engine0 was not kept by the first claim
    assert [p.name for p in second] == ["engine2"] * 3
    held.release()
    third, third_locks = claim_engine_dir(dirs)
    assert [p.name for p in third] == ["engine0"] * 3
    for claim in (locks, second_locks, third_locks):
        claim.release()
    paths, locks = claim_engine_dir(",".join(dirs))  # the flag's string works too
    assert paths == [tmp_path / name / "engine0" for name in ("a", "b", "c")]
    locks.release()
