"""An engine asked to bind its CPU ranks (`LLM(..., bind_cpu_cores=True)`, as a served group's
and `tpserve generate`'s are) runs its process on the core it claimed, at the nice value asked
for, with the same greedy ids as an unbound one; unasked, the caller's process is left where it
was."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CPUS = sorted(os.sched_getaffinity(0))

GENERATE = """
import json, os, torch
torch.set_num_threads(1)
from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
config = EngineConfig(model={model!r}, block_size=4, num_kv_blocks=64, dtype="float32",
                      cpu_rank_nice={nice})
with LLM(config, bind_cpu_cores={bind}) as llm:
    outs = llm.generate([[5, 6, 7, 8], [40, 41]], SamplingParams(max_tokens=6, temperature=0))
print(json.dumps({{"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "ids": [out.output_token_ids for out in outs]}}))
"""


def generate(model_dir, registry, bind, nice=-10):
    env = {**os.environ, "TPSERVE_CORE_REGISTRY": str(registry)}
    env.pop("TPSERVE_NODE_CPUS", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(GENERATE).format(
        model=str(model_dir), bind=bind, nice=nice)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(CPUS) < 2, reason="binding leaves a core free: needs two")
def test_a_bound_engine_runs_on_its_claimed_core_with_the_same_ids(tiny_llama, tmp_path):
    bound = generate(tiny_llama, tmp_path / "cores.json", True)
    free = generate(tiny_llama, tmp_path / "cores.json", False)
    assert bound["cpus"] == [CPUS[0]] and bound["threads"] == 1
    # Raising a priority needs CAP_SYS_NICE: without it the rank keeps nice 0 (the log says so).
    assert bound["nice"] == (-10 if may_raise_priority() else 0)
    assert free["cpus"] == CPUS and free["nice"] == 0
    assert bound["ids"] == free["ids"] and all(len(ids) == 6 for ids in bound["ids"])


def may_raise_priority():
    probe = "import os; os.setpriority(os.PRIO_PROCESS, 0, -1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_a_bad_binding_is_refused_naming_the_flag():
    from workers.config import EngineConfig

    with pytest.raises(ValueError, match="--cpu-binding must be auto or none, got 'cores'"):
        EngineConfig(cpu_binding="cores")


@pytest.mark.parametrize("nice", [-21, 20])
def test_a_nice_value_out_of_range_is_refused_naming_the_flag(nice):
    from workers.config import EngineConfig

    with pytest.raises(ValueError, match=f"--cpu-rank-nice must be from -20 to 19, got {nice}"):
        EngineConfig(cpu_rank_nice=nice)
