"""scripts/bench_engine.py --structured: its arguments, and a tiny run on a model with the
default model's tokenizer (the overhead's figure itself is docs/benchmarks/structured-outputs.md's)."""

from __future__ import annotations

import pytest

from bench_scripts import load_script

from workers.config import EngineConfig
from workers.llm import LLM


@pytest.mark.parametrize("argv, message", [
    (["--structured", "--structured-batch", "1"], "--structured-batch must be at least 2"),
    (["--structured", "--structured-rounds", "0"], "--structured-rounds must be at least 1"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    bench = load_script("bench_engine")
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_structured_run_reports_every_mode(smollm2_tiny):
    bench = load_script("bench_engine")
    from scripts.engine.structured import run_structured

    args = bench.parse_args(["--structured", "--structured-batch", "2", "--structured-tokens",
                             "6", "--structured-rounds", "1"])
    with LLM(EngineConfig(model=str(smollm2_tiny), num_kv_blocks=64, max_model_len=512,
                          record_steps=True)) as llm:
        result = run_structured(llm, args)
    for mode in ("plain", "constrained"):
        assert result[f"{mode}_step_ms"] > 0
    assert result["overhead_frac"] > -1 and result["constrained_total"] == 1
    assert 0 < result["mask_share"] < 1
