"""scripts/chaos.py's arguments (the run itself is a benchmark: docs/benchmarks/chaos.md)."""

from scripts.chaos import parse_args


def test_chaos_runs_fp32_unless_told_otherwise():
    """It checks every streamed output token for token against the idle server's; in bf16 a
    greedy pick at a near tie follows the batch it ran in, so the default is fp32 whatever the
    engine's own default (`auto`: bf16 on CPUs with AMX or AVX-512 BF16)."""
    assert parse_args([]).dtype == "float32"
    assert parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
