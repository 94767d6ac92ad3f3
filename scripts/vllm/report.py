"""The figures of ``bench_vs_vllm.py``, computed from plain result records: output tok/s per
system, dtype and workload (median over rounds), tpserve/vLLM ratios, how far the two systems'
greedy outputs agree, and the machine's CPU."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

SYSTEMS = ("tpserve", "vllm")
DTYPE_KEYS = {"float32": "fp32", "bfloat16": "bf16"}
WORKLOAD_KEYS = {"prefill-heavy": "prefill", "decode-heavy": "decode"}
CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


@dataclass(frozen=True)
class Measurement:
    """One system's run of one workload in one dtype and round."""

    system: str  # "tpserve" or "vllm"
    dtype: str  # "float32" or "bfloat16"
    workload: str  # "prefill-heavy" or "decode-heavy"
    round: int
    wall_s: float
    outputs: Tuple[Tuple[int, ...], ...]  # output token ids, request order
    requested_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def prefix_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]],
                     first_n: int) -> float:
    """Share of the first ``first_n`` output tokens of each request that both systems produce
    before their first difference (greedy outputs part for good at the first differing token),
    over all requests; 1.0 when every request's first ``first_n`` tokens match."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} against {len(b)} requests; expected the same workload")
    matched = compared = 0
    for x, y in zip(a, b):
        n = min(first_n, len(x), len(y))
        same = next((i for i in range(n) if x[i] != y[i]), n)
        matched, compared = matched + same, compared + n
    return matched / compared if compared else 0.0


def _key(m: Measurement) -> str:
    return f"{m.system}_{DTYPE_KEYS[m.dtype]}_{WORKLOAD_KEYS[m.workload]}"


def medians(measurements: Sequence[Measurement]) -> Dict[str, float]:
    """``{system}_{fp32|bf16}_{prefill|decode}`` -> median output tok/s over rounds."""
    rates: Dict[str, List[float]] = {}
    for m in measurements:
        rates.setdefault(_key(m), []).append(m.tokens_per_s)
    return {k: statistics.median(v) for k, v in rates.items()}


def agreements(measurements: Sequence[Measurement], first_n: int) -> Dict[str, float]:
    """``{fp32|bf16}_{prefill|decode}`` -> ``prefix_agreement`` of the first round's outputs."""
    first = {(m.system, m.dtype, m.workload): m for m in measurements
             if m.round == min(x.round for x in measurements)}
    found = {}
    for (system, dtype, workload), m in first.items():
        other = first.get(("vllm", dtype, workload))
        if system == "tpserve" and other is not None:
            key = f"{DTYPE_KEYS[dtype]}_{WORKLOAD_KEYS[workload]}"
            found[key] = prefix_agreement(m.outputs, other.outputs, first_n)
    return found


def summary(measurements: Sequence[Measurement], first_n: int,
            context: Dict[str, object]) -> Dict[str, object]:
    """The last line's object: per-system medians (``*_tokens_per_s``), every
    ``ratio_vs_vllm_{bf16,fp32}_{prefill,decode}`` (None where a dtype was not run), the
    agreement figures, whether every run produced exactly the requested tokens, and
    ``context`` (machine, versions, settings)."""
    rates = medians(measurements)
    result: Dict[str, object] = {f"{k}_tokens_per_s": v for k, v in sorted(rates.items())}
    for dtype in DTYPE_KEYS.values():
        for workload in WORKLOAD_KEYS.values():
            ours = rates.get(f"tpserve_{dtype}_{workload}")
            theirs = rates.get(f"vllm_{dtype}_{workload}")
            result[f"ratio_vs_vllm_{dtype}_{workload}"] = (
                ours / theirs if ours is not None and theirs else None)
    result.update({f"agreement_{k}": v for k, v in agreements(measurements, first_n).items()})
    result["agreement_first_tokens"] = first_n
    result["output_counts_match"] = all(m.num_output_tokens == m.requested_tokens
                                        for m in measurements)
    result["rounds"] = len({m.round for m in measurements})
    result.update(context)
    return result


def table_lines(result: Dict[str, object], dtypes: Sequence[str]) -> List[str]:
    """The printed table: tok/s per system (medians), the ratio and the agreement."""
    n = result["agreement_first_tokens"]
    lines = [f"{'dtype':<7}{'workload':<10}{'tpserve tok/s':>15}{'vLLM tok/s':>12}"
             f"{'tpserve/vLLM':>14}{f'agree first {n}':>17}"]
    for dtype in (DTYPE_KEYS[d] for d in dtypes):
        for workload in WORKLOAD_KEYS.values():
            tp = result.get(f"tpserve_{dtype}_{workload}_tokens_per_s")
            vl = result.get(f"vllm_{dtype}_{workload}_tokens_per_s")
            ratio = result.get(f"ratio_vs_vllm_{dtype}_{workload}")
            agree = result.get(f"agreement_{dtype}_{workload}")
            lines.append(f"{dtype:<7}{workload:<10}{_num(tp, '.1f'):>15}{_num(vl, '.1f'):>12}"
                         f"{_num(ratio, '.2f', 'x'):>14}{_num(agree, '.0%'):>17}")
    counts = "yes" if result["output_counts_match"] else "NO (a system stopped early or ran on)"
    lines.append(f"every run produced exactly the requested output tokens: {counts}")
    return lines


def _num(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def cpu_info(cpuinfo_text: str) -> Dict[str, object]:
    """The CPU model and the instruction-set flags that decide bf16 and fp32 speed, from the
    text of ``/proc/cpuinfo`` (first processor)."""
    fields: Dict[str, str] = {}
    for line in cpuinfo_text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name"),
            "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS}}
