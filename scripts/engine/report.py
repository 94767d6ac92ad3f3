"""``bench_engine.py``'s results per workload (``WorkloadReport``: tpserve, its steps, the
baselines and each step at the machine's limit) and their reporting: the table, the per-step
breakdown, the steps file and the JSON figures."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

from workers.engine import StepRecord

from scripts.engine.limits import ModelCost
from scripts.engine.systems import RunResult
from scripts.engine.workloads import Workload


@dataclass
class WorkloadReport:
    workload: Workload
    tpserve: RunResult
    steps: List[StepRecord]
    baselines: Dict[str, RunResult]
    step_limits_s: List[float] = field(default_factory=list)  # per step, at the machine's limit

    def compute_limits(self, cost: ModelCost, machine: Dict[str, float]) -> None:
        self.step_limits_s = [cost.step_limit_s(s, machine["read_gbps"], machine["matmul_gflops"])
                              for s in self.steps]

    @property
    def limit_s(self) -> float:
        return sum(self.step_limits_s)

    def tokens_per_s(self, result: RunResult) -> float:
        return result.num_output_tokens / result.wall_s

    def total_tokens_per_s(self, result: RunResult) -> float:
        return (self.workload.num_prompt_tokens + result.num_output_tokens) / result.wall_s


def print_table(report: WorkloadReport) -> None:
    w, tp = report.workload, report.tpserve
    print(f"\n{w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt tokens, "
          f"{w.num_output_tokens} output tokens requested")
    print(f"  {'system':<16}{'wall s':>9}{'out tok':>9}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'wall/tpserve':>14}{'same ids':>10}{'load':>6}")
    limit_tps = tp.num_output_tokens / report.limit_s
    print(f"  {'machine limit':<16}{report.limit_s:>9.1f}{tp.num_output_tokens:>9}"
          f"{limit_tps:>11.1f}{'':>13}{report.limit_s / tp.wall_s:>14.2f}")
    for result in [tp, *report.baselines.values()]:
        same = sum(a == b for a, b in zip(result.outputs, tp.outputs)) / len(tp.outputs)
        print(f"  {result.system:<16}{result.wall_s:>9.1f}{result.num_output_tokens:>9}"
              f"{report.tokens_per_s(result):>11.1f}{report.total_tokens_per_s(result):>13.1f}"
              f"{result.wall_s / tp.wall_s:>14.2f}{same:>10.0%}"
              f"{result.extra['load_average']:>6.1f}")
    counts = {r.system: r.num_output_tokens for r in [tp, *report.baselines.values()]}
    print(f"  output tokens generated: {counts}: "
          f"{'equal' if len(set(counts.values())) == 1 else 'NOT EQUAL'}")
    _print_step_breakdown(report)
    print(f"  KV waste {tp.extra['kv_waste_frac']:.2%} of allocated slots (slot-weighted over "
          f"steps; step mean {tp.extra['kv_waste_frac_step_mean']:.2%}), peak pool use "
          f"{tp.extra['kv_peak_usage']:.1%}")
    if "hf_generate" in report.baselines:
        computed = report.baselines["hf_generate"].extra["computed_output_tokens"]
        print(f"  hf_generate computed {computed:.0f} output tokens (batches run to their "
              f"longest output), counted {report.baselines['hf_generate'].num_output_tokens}")


def _print_step_breakdown(report: WorkloadReport) -> None:
    pairs = list(zip(report.steps, report.step_limits_s))
    groups = {"with prefill": [(s, t) for s, t in pairs if not s.is_decode_only],
              "decode only": [(s, t) for s, t in pairs if s.is_decode_only]}
    overhead = report.tpserve.wall_s - report.tpserve.extra["step_s"]
    print(f"  tpserve steps: {len(report.steps)}; outside steps {overhead:.2f} s "
          f"(tokenize, add_request, loop)")
    for name, steps in groups.items():
        if steps:
            measured = sum(s.duration_s for s, _ in steps)
            limit = sum(t for _, t in steps)
            print(f"    {name:<13} {len(steps):>5} steps {sum(s.num_tokens for s, _ in steps):>7} "
                  f"tokens  measured {measured:7.2f} s  at limit {limit:7.2f} s  "
                  f"({limit / measured:.0%})")


def write_steps(path: Path, reports: Sequence[WorkloadReport]) -> None:
    with open(path, "w") as f:
        for report in reports:
            for step, limit_s in zip(report.steps, report.step_limits_s):
                f.write(json.dumps({"workload": report.workload.name, "seqs": step.seqs,
                                    "num_logits": step.num_logits,
                                    "duration_s": step.duration_s, "limit_s": limit_s}) + "\n")
    print(f"steps written to {path}")


def summary(report: WorkloadReport, prefix: str) -> Dict[str, object]:
    tp = report.tpserve
    tps = report.tokens_per_s(tp)
    figures: Dict[str, object] = {
        "tokens_per_s": tps,
        "total_tokens_per_s": report.total_tokens_per_s(tp),
        "limit_tokens_per_s": tp.num_output_tokens / report.limit_s,
        "roofline_frac": report.limit_s / tp.wall_s,
        "kv_waste_frac": tp.extra["kv_waste_frac"],
        "kv_waste_frac_step_mean": tp.extra["kv_waste_frac_step_mean"],
        "wall_s": tp.wall_s,
        "prompt_tokens": report.workload.num_prompt_tokens,
        "output_tokens": tp.num_output_tokens,
        "num_steps": len(report.steps),
    }
    for name in ("hf_generate", "hf_cb"):
        result = report.baselines.get(name)
        rate = report.tokens_per_s(result) if result else None
        figures[f"{name}_tokens_per_s"] = rate
        figures[f"ratio_vs_{name}"] = tps / rate if rate else None
        figures[f"{name}_output_tokens"] = result.num_output_tokens if result else None
    return {f"{prefix}{k}": v for k, v in figures.items()}
