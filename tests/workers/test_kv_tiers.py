"""KV tiers through the real engine: blocks spill to host and disk and come back, and greedy output
still equals transformers token for token; corrupted bytes are caught; a restarted engine reuses
the disk tier.

The device pool (16 blocks of 4 tokens) holds one request at a time, so three prompt families with
24-token shared prefixes evict each other from the device: their second requests find the prefix
only on host (or, with a 6-block host tier, on disk).

Tests taking ``checksum`` run twice: with xxh3 (what a CPU pool gets) and with mix64 through the
copier's device path, hashed by the CuPy kernel's numpy twin (what a CUDA pool with CuPy runs,
all but the kernel launch itself).
"""

import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from kv.tiers import block_copier
from kv.integrity.block_checksum import ReferenceBlockHasher, mix64_strategy
from tiny_models import build_checkpoint, hf_greedy
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams

MAX_NEW = 12
BLOCK = 4


def make_prompts():
    rng = random.Random(11)
    tokens = lambda n: [rng.randrange(3, 509) for _ in range(n)]  # noqa: E731
    prefixes = [tokens(24) for _ in range(3)]
    first = [p + tokens(5) for p in prefixes]
    second = [p + tokens(7) for p in prefixes]
    return first, second


FIRST, SECOND = make_prompts()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiers") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def references(model_dir):
    return hf_greedy(model_dir, FIRST + SECOND, MAX_NEW)


@pytest.fixture(params=["xxh3", "mix64-device"])
def checksum(request, monkeypatch):
    """The checksum strategy of every engine the test starts (the name it must report)."""
    if request.param == "mix64-device":
        monkeypatch.setattr(block_copier, "choose_block_checksum",
                            lambda kv_cache: mix64_strategy(ReferenceBlockHasher(kv_cache)))
    return request.param.split("-")[0]


def check_checksum(llm, name):
    assert llm.engine.rank.tiers.transfer.checksum.name == name


def config(model_dir, **overrides):
    base = dict(model=str(model_dir), block_size=BLOCK, num_kv_blocks=16, max_num_seqs=1,
                host_kv_blocks=64, dtype="float32")
    base.update(overrides)
    return EngineConfig(**base)


def generate(llm, prompts):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    return [out.output_token_ids for out in llm.generate(prompts, params)]


def tier_stats(llm):
    return llm.engine.scheduler.kv.tiers


def test_host_tier_restores_evicted_prefixes(model_dir, references):
    with LLM(config(model_dir)) as llm:
        assert generate(llm, FIRST) == references[:3]
        assert generate(llm, SECOND) == references[3:]
        tiers = tier_stats(llm)
        assert tiers.stats.num_spilled_blocks > 0
        assert tiers.host.num_hits >= 2 * 6  # at least two families came back from host
        assert tiers.stats.num_restored_blocks >= 12
        assert tiers.stats.num_checksum_failures == 0
        assert llm.engine.scheduler.kv.pool.num_evicted > 0
        stats = llm.engine.kv_tier_stats()
        block_bytes = llm.engine.rank.tiers.host.block_nbytes
        assert stats["kv_tier_host_hits_total"] == tiers.host.num_hits
        assert stats["kv_tier_host_blocks_total"] == 64
        assert stats["kv_tier_spilled_bytes_total"] == tiers.stats.num_spilled_blocks * block_bytes
        assert stats["kv_tier_restored_bytes_total"] == tiers.stats.num_restored_blocks * block_bytes
        assert stats["kv_tier_transfer_latency_seconds"]  # samples since the engine started


def test_without_tiers_the_same_workload_recomputes(model_dir, references):
    """The baseline of the test above: the device alone cannot keep the prefixes."""
    cfg = config(model_dir, host_kv_blocks=None)
    with LLM(cfg) as llm:
        assert generate(llm, FIRST + SECOND) == references
        kv = llm.engine.scheduler.kv
        assert kv.tiers is None and kv.num_prefix_hits < 2 * 24


@pytest.mark.parametrize("eviction", ["lru", "hotness"])
def test_disk_tier_restores_through_host(model_dir, references, tmp_path, eviction, checksum):
    cfg = config(model_dir, host_kv_blocks=6, disk_kv_dir=str(tmp_path / "kv"),
                 disk_kv_blocks=64, kv_eviction=eviction)
    with LLM(cfg) as llm:
        check_checksum(llm, checksum)
        assert generate(llm, FIRST) == references[:3]
        assert generate(llm, SECOND) == references[3:]
        tiers = tier_stats(llm)
        assert tiers.stats.num_disk_written_blocks > 0
        assert tiers.disk.num_hits > 0 and tiers.stats.num_disk_read_blocks > 0
        assert tiers.stats.num_checksum_failures == 0 and tiers.stats.num_io_errors == 0


def test_write_back_spills_on_eviction_and_restores_with_parity(model_dir, references, tmp_path):
    cfg = config(model_dir, host_kv_blocks=6, disk_kv_dir=str(tmp_path / "kv"),
                 disk_kv_blocks=64, kv_write_policy="write_back")
    with LLM(cfg) as llm:
        assert generate(llm, FIRST) == references[:3]
        assert generate(llm, SECOND) == references[3:]
        tiers = tier_stats(llm)
        assert tiers.stats.num_written_back > 0
        assert tiers.stats.num_spilled_blocks == tiers.stats.num_written_back
        assert tiers.host.num_hits + tiers.disk.num_hits >= 2 * 6
        assert llm.engine.kv_tier_stats()["kv_tier_written_back_total"] > 0


def test_selective_write_through_keeps_one_off_blocks_on_the_device(model_dir, references):
    """No block of these prompts is hit before its release: nothing goes down, and the second
    requests recompute their evicted prefixes (same output)."""
    with LLM(config(model_dir, kv_write_policy="write_through_selective")) as llm:
        assert generate(llm, FIRST + SECOND) == references
        tiers = tier_stats(llm)
        assert tiers.stats.num_spilled_blocks == 0 and tiers.host.num_hits == 0


def test_a_spill_bound_drops_spills_and_keeps_parity(model_dir, references):
    spill_gbps = 1e-5
    with LLM(config(model_dir, kv_spill_gbps=spill_gbps)) as llm:
        steps = count_steps(llm.engine)
        started = time.monotonic()
        assert generate(llm, FIRST + SECOND) == references
        elapsed_s = time.monotonic() - started
        stats = llm.engine.kv_tier_stats()
        assert stats["kv_tier_spills_dropped_total"] > 0
        # The bound's bucket: its burst (one block) plus what the rate paid for while the
        # requests ran, however slow a loaded host made them, give or take a block of rounding.
        # (Unbounded, these requests spill about 40 blocks; a fixed limit failed on slow hosts.)
        block_bytes = llm.engine.scheduler.kv.tiers.pacer.item_bytes
        paid_blocks = 2 + int(elapsed_s * spill_gbps * 1e9 / block_bytes)
        assert tier_stats(llm).stats.num_spilled_blocks <= paid_blocks, (elapsed_s, block_bytes)
        # With every request done and spills still waiting for their bandwidth, the engine
        # waits for the bucket instead of running empty steps back to back (273,000 of them in
        # 3 s, a core at 100% while idle, before).
        assert steps["empty"] < 500, steps


def count_steps(engine) -> dict:
    """Counts the engine's steps from now on, and those with nothing to compute."""
    counts = {"all": 0, "empty": 0}
    schedule = engine.scheduler.schedule

    def counted():
        scheduled = schedule()
        counts["all"] += 1
        counts["empty"] += not scheduled.plan.seqs
        return scheduled

    engine.scheduler.schedule = counted
    return counts


def test_preemption_swaps_to_host_and_back(model_dir):
    prompts = [FIRST[0][:20], FIRST[1][:18], FIRST[2][:22]]
    reference = hf_greedy(model_dir, prompts, 24)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with LLM(config(model_dir, num_kv_blocks=20, max_num_seqs=3)) as llm:
        outs = [o.output_token_ids for o in llm.generate(prompts, params)]
        stats = tier_stats(llm).stats
        assert llm.engine.scheduler.num_preemptions > 0
        assert stats.num_swapped_out > 0 and stats.num_swapped_in > 0  # came back, not recomputed
        assert stats.num_checksum_failures == 0
    assert outs == reference


def test_preemption_with_a_host_tier_of_private_slots_recomputes(model_dir):
    """One host slot: the first preempted request's tail takes it, so write-through has nowhere
    to put anyone's blocks; the engine skips those copies, recomputes and still matches."""
    prompts = [FIRST[0][:20], FIRST[1][:18], FIRST[2][:22]]
    reference = hf_greedy(model_dir, prompts, 24)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    with LLM(config(model_dir, num_kv_blocks=20, max_num_seqs=3, host_kv_blocks=1)) as llm:
        outs = [o.output_token_ids for o in llm.generate(prompts, params)]
        stats = tier_stats(llm).stats
        assert llm.engine.scheduler.num_preemptions > 0
        assert stats.num_swapped_out > 0 and stats.num_spills_skipped > 0
        assert stats.num_checksum_failures == 0
    assert outs == reference


def _flip_first_byte(tensor_or_path, offset=0):
    if isinstance(tensor_or_path, str):
        with open(tensor_or_path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        tensor_or_path[offset] ^= 0xFF


def test_corrupted_host_block_is_caught_and_recomputed(model_dir, references, checksum):
    with LLM(config(model_dir)) as llm:
        check_checksum(llm, checksum)
        assert generate(llm, FIRST) == references[:3]
        tiers = tier_stats(llm)
        kv = llm.engine.scheduler.kv
        request_hashes = _prefix_hashes(FIRST[0])
        assert all(kv.pool.lookup(h, t) is None for h, t in request_hashes[:1])  # evicted
        slot = tiers.host.entries[request_hashes[2][0]].slot
        _flip_first_byte(llm.engine.rank.tiers.host.slot(slot), offset=100)
        restored_before = tiers.stats.num_restored_blocks
        assert generate(llm, SECOND[:1]) == references[3:4]
        assert tiers.stats.num_checksum_failures == 1
        assert tiers.stats.num_restored_blocks == restored_before + 6  # the whole prefix was tried
        # Recomputed from the corrupt block on, spilled again: the next pass reads clean copies.
        assert generate(llm, FIRST[1:2] + FIRST[:1]) == [references[1], references[0]]
        assert tiers.stats.num_checksum_failures == 1


def test_corrupted_disk_block_is_caught_and_recomputed(model_dir, references, tmp_path,
                                                       checksum):
    disk_dir = tmp_path / "kv"
    cfg = config(model_dir, host_kv_blocks=2, disk_kv_dir=str(disk_dir), disk_kv_blocks=64)
    with LLM(cfg) as llm:
        check_checksum(llm, checksum)
        assert generate(llm, FIRST) == references[:3]
        tiers = tier_stats(llm)
        on_disk = [h for h, _ in _prefix_hashes(FIRST[0])
                   if h in tiers.disk.entries and h not in tiers.host.entries]
        assert on_disk
        slot = tiers.disk.entries[on_disk[0]].slot
        slot_bytes = llm.engine.rank.tiers.disk.slot_bytes
        _flip_first_byte(str(disk_dir / "engine0" / "rank0" / "blocks.bin"), slot * slot_bytes + 64)
        assert generate(llm, SECOND[:1]) == references[3:4]
        assert tiers.stats.num_checksum_failures == 1
        assert on_disk[0] not in tiers.disk.entries


def _prefix_hashes(prompt):
    from kv.prefix_hash import extend_block_hashes
    hashes = extend_block_hashes([], prompt, BLOCK)
    return [(h, tuple(prompt[i * BLOCK:(i + 1) * BLOCK])) for i, h in enumerate(hashes)]


def test_restart_reuses_the_disk_tier(model_dir, references, tmp_path, caplog, checksum):
    disk_dir = tmp_path / "kv"
    cfg = config(model_dir, host_kv_blocks=4, disk_kv_dir=str(disk_dir), disk_kv_blocks=64)
    with LLM(cfg) as llm:
        check_checksum(llm, checksum)
        assert generate(llm, FIRST) == references[:3]
        assert tier_stats(llm).stats.num_disk_written_blocks > 0
    shutil.copytree(disk_dir, tmp_path / "truncated")
    with LLM(cfg) as llm:
        tiers = tier_stats(llm)
        assert len(tiers.disk.entries) > 0  # recovered from the snapshot
        assert generate(llm, SECOND) == references[3:]
        assert tiers.disk.num_hits > 0
        assert tiers.stats.num_checksum_failures == 0

    # A truncated snapshot and a stray file: warnings, nothing reused, output still right.
    snapshot = tmp_path / "truncated" / "engine0" / "rank0" / "tokens.snapshot"
    snapshot.write_bytes(snapshot.read_bytes()[:-10])
    (tmp_path / "truncated" / "engine0" / "rank0" / "stray.bin").write_bytes(b"x" * 100)
    caplog.clear()
    with LLM(config(model_dir, host_kv_blocks=4, disk_kv_dir=str(tmp_path / "truncated"),
                    disk_kv_blocks=64)) as llm:
        assert len(tier_stats(llm).disk.entries) == 0
        assert generate(llm, SECOND) == references[3:]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "truncated" in messages and "stray.bin" in messages


def test_restart_with_another_model_ignores_the_disk_tier(model_dir, tmp_path, caplog):
    disk_dir = tmp_path / "kv"
    cfg = config(model_dir, host_kv_blocks=4, disk_kv_dir=str(disk_dir), disk_kv_blocks=64)
    with LLM(cfg) as llm:
        generate(llm, FIRST)
    other = build_checkpoint(tmp_path / "other", "llama", seed=4)
    caplog.clear()
    with LLM(config(other, host_kv_blocks=4, disk_kv_dir=str(disk_dir),
                    disk_kv_blocks=64)) as llm:
        assert len(tier_stats(llm).disk.entries) == 0
        assert generate(llm, SECOND[:1]) == hf_greedy(other, SECOND[:1], MAX_NEW)
    assert "another model" in " ".join(r.getMessage() for r in caplog.records)


def test_restart_reuses_a_striped_disk_tier_and_counts_bytes_per_directory(
        model_dir, references, tmp_path, caplog):
    """Three directories, 24 disk blocks: stripe units of 8 blocks, one in each directory. The
    same list finds its blocks again; another order or count starts cold, with a warning."""
    dirs = [str(tmp_path / name) for name in ("a", "b", "c")]
    cfg = lambda names: config(model_dir, host_kv_blocks=4, disk_kv_blocks=24,  # noqa: E731
                               disk_kv_dir=",".join(names))
    with LLM(cfg(dirs)) as llm:
        assert generate(llm, FIRST) == references[:3]
        stats = llm.engine.kv_tier_stats()
    written = stats["kv_tier_disk_dir_written_bytes_total"]
    assert sorted(written) == dirs and all(written[d] > 0 for d in dirs)
    assert sum(written.values()) == stats["kv_tier_disk_written_bytes_total"]
    assert sorted(stats["kv_tier_disk_dir_read_bytes_total"]) == dirs
    for d in dirs:  # the same engine0/rank0 in every directory; snapshots in the first only
        files = sorted(p.name for p in (tmp_path / d / "engine0" / "rank0").iterdir())
        expected = ["blocks.bin", "checksums.snapshot", "tokens.snapshot"] if d == dirs[0] \
            else ["blocks.bin"]
        assert [f for f in files if not f.startswith(".")] == expected

    with LLM(cfg(dirs)) as llm:
        tiers = tier_stats(llm)
        assert len(tiers.disk.entries) > 0  # recovered through the striped layout
        assert generate(llm, SECOND) == references[3:]
        assert tiers.disk.num_hits > 0 and tiers.stats.num_checksum_failures == 0
        read = llm.engine.kv_tier_stats()["kv_tier_disk_dir_read_bytes_total"]
        assert sum(read.values()) == llm.engine.kv_tier_stats()["kv_tier_disk_read_bytes_total"]
        assert sum(read.values()) > 0

    # Another count or order: the first directory's snapshot is another layout's. Another first
    # directory: the old first one's snapshot is removed (its blocks are about to be overwritten).
    a, b, c = dirs
    for changed, words in (([b, a, c], "came first in --disk-kv-dir"),
                           ([a, b, c], "came first in --disk-kv-dir"),  # a's blocks were b,a,c's
                           ([a, b], "another model or KV layout"),
                           ([a, c, b], "another model or KV layout")):
        caplog.clear()
        with LLM(cfg(changed)) as llm:
            tiers = tier_stats(llm)
            assert len(tiers.disk.entries) == 0  # nothing misread
            assert generate(llm, SECOND) == references[3:]
            assert tiers.stats.num_checksum_failures == 0
        assert words in " ".join(r.getMessage() for r in caplog.records), changed


@pytest.mark.multiproc
def test_tp2_spills_to_host_and_disk_and_matches_transformers(model_dir, references, tmp_path):
    cfg = config(model_dir, tp_size=2, host_kv_blocks=6, disk_kv_dir=str(tmp_path / "kv"),
                 disk_kv_blocks=64)
    with LLM(cfg) as llm:
        assert generate(llm, FIRST) == references[:3]
        assert generate(llm, SECOND) == references[3:]
        tiers = tier_stats(llm)
        assert tiers.host.num_hits + tiers.disk.num_hits > 0
        assert tiers.disk.num_hits > 0
        assert tiers.stats.num_checksum_failures == 0
    assert (tmp_path / "kv" / "engine0" / "rank1" / "blocks.bin").stat().st_size > 0


def test_truncated_disk_file_degrades_to_recompute(model_dir, references, tmp_path):
    """Reads past the end fail (short read); slots in the hole that later writes leave behind
    read back as zeros and fail their checksum. Either way: counted, recomputed, served."""
    disk_dir = tmp_path / "kv"
    cfg = config(model_dir, host_kv_blocks=2, disk_kv_dir=str(disk_dir), disk_kv_blocks=64)
    with LLM(cfg) as llm:
        assert generate(llm, FIRST) == references[:3]
        tiers = tier_stats(llm)
        os.truncate(disk_dir / "engine0" / "rank0" / "blocks.bin", 0)
        assert generate(llm, SECOND) == references[3:]
        assert tiers.stats.num_io_errors + tiers.stats.num_checksum_failures > 0
        assert tiers.disk.num_hits > 0  # the engine did try to read them


WRITE_LIMIT_SCRIPT = """
import json, resource, signal, sys
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
args = json.loads(sys.argv[1])
with LLM(EngineConfig(**args["config"])) as llm:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # From here on the process may not write past 3 disk slots: writes beyond fail with EFBIG.
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 4096, resource.RLIM_INFINITY))
    params = SamplingParams(max_tokens=args["max_new"], temperature=0.0)
    outs = [o.output_token_ids for o in llm.generate(args["prompts"], params)]
    print(json.dumps({"outs": outs, "io_errors": llm.engine.scheduler.kv.tiers.stats.num_io_errors}))
"""


def test_disk_write_errors_degrade_to_recompute(model_dir, references, tmp_path):
    cfg = dict(model=str(model_dir), block_size=BLOCK, num_kv_blocks=16, max_num_seqs=1,
               host_kv_blocks=2, disk_kv_dir=str(tmp_path / "kv"), disk_kv_blocks=64,
               dtype="float32")
    payload = json.dumps({"config": cfg, "prompts": FIRST + SECOND, "max_new": MAX_NEW})
    result = subprocess.run([sys.executable, "-c", WRITE_LIMIT_SCRIPT, payload],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["outs"] == references
    assert report["io_errors"] > 0


@pytest.mark.timeout(120)
def test_a_broken_transfer_worker_fails_the_engine_step(model_dir, tmp_path):
    """A rank's disk store closed under the running engine is no I/O error to recompute around:
    the step raises (so the group is replaced) instead of hanging, and shutdown still returns."""
    cfg = config(model_dir, host_kv_blocks=2, disk_kv_dir=str(tmp_path / "kv"), disk_kv_blocks=64)
    llm = LLM(cfg)
    try:
        llm.engine.rank.tiers.disk.close()
        with pytest.raises(RuntimeError, match=r"KV transfers failed: .*WriteDisk.*is closed"):
            generate(llm, FIRST)
    finally:
        try:
            llm.shutdown()
        except RuntimeError:
            pass  # draining the failed transfers raises the same error again


def test_two_engines_share_a_disk_dir_in_separate_subdirectories(model_dir, references, tmp_path):
    cfg = config(model_dir, host_kv_blocks=2, disk_kv_dir=str(tmp_path / "kv"), disk_kv_blocks=64)
    with LLM(cfg) as first, LLM(cfg) as second:
        assert generate(first, FIRST[:1]) == references[:1]
        assert generate(second, FIRST[1:2]) == references[1:2]
        assert {p.name for p in (tmp_path / "kv").iterdir()} == {"engine0", "engine1"}
    with LLM(cfg) as again:  # both released: a new engine takes engine0 and its blocks back
        assert len(tier_stats(again).disk.entries) > 0
