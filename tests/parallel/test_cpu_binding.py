"""parallel/cpu_binding.py: ranks claim the lowest unclaimed cores while one stays free, run
every thread of their process there at the nice value asked for (where they may), and claims of
exited processes are dropped. Pinning runs in child processes (it would pin the test
process)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from parallel.cpu_binding import (CoreBinding, cpu_quota, parse_cpu_list, process_start_time,
                                  release_cores, serving_cores)

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="binding leaves a core free: needs two")


def claims(path):
    return json.loads(path.read_text())["claims"]


def live_claim(cores, pid=None):
    pid = pid or os.getpid()
    return {"pid": pid, "start": process_start_time(pid), "cores": list(cores)}


def write_claims(path, entries):
    path.write_text(json.dumps({"claims": entries}))


def run_child(code, registry, node_cpus=None, stderr=None):
    """``code`` in a fresh interpreter with the registry (and node cores) set; its stdout's
    last line as JSON (its stderr appended to the list ``stderr``)."""
    env = {**os.environ, "TPSERVE_CORE_REGISTRY": str(registry)}
    if node_cpus is not None:
        env["TPSERVE_NODE_CPUS"] = node_cpus
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if stderr is not None:
        stderr.append(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


BIND = """
    import json, logging, os, threading
    from parallel.cpu_binding import bind_rank_cores
    logging.basicConfig(level=logging.INFO)
    {before_bind}
    before = threading.Thread(target=threading.Event().wait, daemon=True)
    before.start()
    binding = bind_rank_cores({threads}, nice={nice})
    seen = []
    after = threading.Thread(target=lambda: seen.append(
        (sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))))
    after.start(); after.join()
    tasks, nice = {{}}, set()
    for tid in os.listdir("/proc/self/task"):
        try:
            tasks[tid] = sorted(os.sched_getaffinity(int(tid)))
            nice.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    print(json.dumps({{"cores": binding and list(binding.cores),
                      "unclaimed": binding and list(binding.unclaimed),
                      "nice": binding and binding.nice,
                      "threads": sorted(set(map(tuple, tasks.values()))),
                      "threads_nice": sorted(nice), "new_thread": seen[0][0],
                      "new_thread_nice": seen[0][1], "pid": os.getpid()}}))
"""
# CAP_SYS_NICE (bit 23) out of this thread's effective capabilities (capget/capset, version 3).
DROP_SYS_NICE = """import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    caps = (ctypes.c_uint32 * 6)()
    assert libc.capget(header, caps) == 0
    caps[0] &= ~(1 << 23)
    assert libc.capset(header, caps) == 0"""


def bind_code(threads=1, nice=0, before_bind=""):
    return BIND.format(threads=threads, nice=nice, before_bind=before_bind)


def may_raise_priority():
    probe = "import os; os.setpriority(os.PRIO_PROCESS, 0, -1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@needs_two
def test_a_rank_claims_the_lowest_core_and_every_thread_runs_there(tmp_path):
    registry = tmp_path / "cores.json"
    out = run_child(bind_code(), registry)
    assert out["cores"] == [CPUS[0]] and out["unclaimed"] == CPUS[1:]
    assert out["threads"] == [[CPUS[0]]]  # the thread started before the claim too
    assert out["new_thread"] == [CPUS[0]]
    assert [c["cores"] for c in claims(registry) if c["pid"] == out["pid"]] == [[CPUS[0]]]
    assert out["nice"] == 0 and out["threads_nice"] == [0]  # nice 0: left as it was


@needs_two
@pytest.mark.skipif(not may_raise_priority(), reason="raising a priority needs CAP_SYS_NICE")
def test_a_rank_runs_every_thread_at_the_nice_value_asked_for(tmp_path):
    out = run_child(bind_code(nice=-10), tmp_path / "cores.json")
    assert out["cores"] == [CPUS[0]] and out["nice"] == -10
    assert out["threads_nice"] == [-10]  # the thread started before the claim too
    assert out["new_thread_nice"] == -10


@needs_two
@pytest.mark.skipif(not may_raise_priority(), reason="the test drops CAP_SYS_NICE: needs it")
def test_a_rank_that_may_not_raise_its_priority_keeps_it_and_its_cores_and_says_why(tmp_path):
    stderr = []
    out = run_child(bind_code(nice=-10, before_bind=DROP_SYS_NICE), tmp_path / "cores.json",
                    stderr=stderr)
    assert out["cores"] == [CPUS[0]] and out["threads"] == [[CPUS[0]]]
    assert out["nice"] == 0 and out["threads_nice"] == [0]
    assert "stays at nice 0: it may not take nice -10" in stderr[0]
    assert "CAP_SYS_NICE" in stderr[0] and "--cpu-rank-nice 0" in stderr[0]


def test_a_nice_value_out_of_range_is_refused():
    from parallel.cpu_binding import set_process_nice

    with pytest.raises(ValueError, match="nice must be from -20 to 19, got 20"):
        set_process_nice(20)


@needs_two
def test_the_next_rank_takes_the_next_core_and_one_is_always_left(tmp_path):
    registry = tmp_path / "cores.json"
    write_claims(registry, [live_claim([CPUS[0]])])  # this test process holds the first core
    out = run_child(bind_code(), registry, node_cpus=f"{CPUS[0]}-{CPUS[0] + 2}")
    assert out["cores"] == [CPUS[0] + 1] and out["unclaimed"] == [CPUS[0] + 2]
    full = run_child(bind_code(), registry, node_cpus=f"{CPUS[0]},{CPUS[1]}")
    assert full["cores"] is None  # the only unclaimed core stays for the rest
    assert full["threads"] == [CPUS]  # and nothing was pinned


@needs_two
def test_a_rank_wanting_more_cores_than_can_be_spared_claims_none(tmp_path):
    out = run_child(bind_code(len(CPUS)), tmp_path / "cores.json")
    assert out["cores"] is None and out["threads"] == [CPUS]


@needs_two
def test_claims_of_exited_or_reused_processes_are_dropped(tmp_path):
    registry = tmp_path / "cores.json"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    reused = {**live_claim([CPUS[1]]), "start": -1}  # this pid, another start time
    write_claims(registry, [live_claim([CPUS[0]], gone.pid), reused])
    out = run_child(bind_code(), registry)
    assert out["cores"] == [CPUS[0]]
    assert [c["pid"] for c in claims(registry)] == [out["pid"]]


@needs_two
def test_a_torn_registry_is_started_afresh(tmp_path):
    registry = tmp_path / "cores.json"
    registry.write_text('{"claims": [{"pid": ')
    assert run_child(bind_code(), registry)["cores"] == [CPUS[0]]


def test_an_unwritable_registry_leaves_the_rank_unbound(tmp_path):
    out = run_child(bind_code(), tmp_path / "missing-dir" / "cores.json")
    assert out["cores"] is None and out["threads"] == [CPUS]


def test_serving_cores_are_what_the_ranks_leave(tmp_path):
    registry = tmp_path / "cores.json"
    assert serving_cores(1, cpus=(0, 1), registry=registry) == (1,)
    assert serving_cores(2, cpus=(0, 1, 2, 3), registry=registry) == (2, 3)
    assert serving_cores(2, cpus=(0, 1), registry=registry) is None  # none left for the rest
    assert serving_cores(1, threads_per_rank=2, cpus=(0, 1, 2), registry=registry) == (2,)
    write_claims(registry, [live_claim([0])])
    assert serving_cores(1, cpus=(0, 1, 2), registry=registry) == (2,)


def test_release_drops_only_this_process_claim(tmp_path):
    registry = tmp_path / "cores.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_claims(registry, [live_claim([0]), live_claim([1], other.pid)])
        release_cores(registry)
        assert [c["pid"] for c in claims(registry)] == [other.pid]
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("text, cores", [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)),
                                         (" 2 , 0-1", (0, 1, 2))])
def test_cpu_lists(text, cores):
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "0,,1", "-2", "3-1"])
def test_a_bad_cpu_list_names_the_variable_and_the_entry(text):
    with pytest.raises(ValueError, match="TPSERVE_NODE_CPUS"):
        parse_cpu_list(text)


def test_binding_is_a_frozen_contract():
    binding = CoreBinding((0,), (1,))
    with pytest.raises(AttributeError):
        binding.cores = (1,)


@pytest.mark.parametrize("files, cpus", [
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     None),
    ({}, None),
])
def test_cgroup_quotas(tmp_path, files, cpus):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == cpus


def test_a_node_shared_by_quota_binds_nothing(tmp_path, monkeypatch):
    import parallel.cpu_binding as binding

    monkeypatch.setattr(binding, "cpu_quota", lambda: len(CPUS) - 0.5)
    monkeypatch.setenv("TPSERVE_NODE_CPUS", ",".join(map(str, CPUS)))
    registry = tmp_path / "cores.json"
    assert binding.bind_rank_cores(1, registry=registry) is None  # before anything is pinned
    assert binding.serving_cores(1, registry=registry) is None
    assert sorted(os.sched_getaffinity(0)) == CPUS and not registry.exists()


def test_a_core_this_process_may_not_run_on_binds_nothing_and_keeps_no_claim(tmp_path):
    registry = tmp_path / "cores.json"
    absent = max(CPUS) + 1000
    out = run_child(bind_code(), registry, node_cpus=f"{absent}-{absent + 1}")
    assert out["cores"] is None and out["threads"] == [CPUS]
    assert claims(registry) == []
