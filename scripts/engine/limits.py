"""The machine's limit for ``bench_engine.py``'s runs (its docstring has the formulas): the memory
read bandwidth and the fp32 matmul rate measured in this process, and each step's bytes and FLOPs
(``ModelCost``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from parallel.onednn_linear import PackedWeight, can_pack
from workers.engine import StepRecord
from workers.model_config import ModelConfig


def _best_of(fn, repeats: int = 3) -> float:
    """Shortest wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_read_gbps(gib: float = 1.0) -> float:
    """Memory read bandwidth: bytes of a ``gib`` GiB fp32 tensor over the best time to sum it."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    seconds = _best_of(lambda: x.sum().item())
    return x.numel() * 4 / seconds / 1e9


def measure_matmul_gflops(model: ModelConfig) -> Tuple[float, float]:
    """fp32 rates of a 2048^3 product and of the model's MLP up-projection on 2048 tokens, each
    the better of torch's ``mm``/``linear`` and the packed oneDNN linear that tpserve's CPU
    layers run (``parallel/onednn_linear.py``; on some CPUs twice MKL's rate)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    square = 2 * 2048 ** 3 / min(_best_of(lambda: torch.mm(a, b)), _packed_s(a, b.T)) / 1e9
    x = torch.randn(2048, model.hidden_size)  # [T, H]
    w = torch.randn(model.intermediate_size, model.hidden_size)  # [I, H]
    flops = 2 * 2048 * model.hidden_size * model.intermediate_size
    shaped = flops / min(_best_of(lambda: torch.nn.functional.linear(x, w)), _packed_s(x, w)) / 1e9
    return square, shaped


def _packed_s(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Best time of ``x @ weight.T`` through a packed oneDNN weight (inf where unavailable)."""
    if not can_pack(weight):
        return float("inf")
    packed = PackedWeight(weight)
    return _best_of(lambda: packed.linear(x))


# ----- roofline -----


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of the model's parts (see the module docstring)."""

    linear_params: int
    lm_head_params: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int
    bytes_per_param: int

    @classmethod
    def of(cls, m: ModelConfig, bytes_per_param: int) -> "ModelCost":
        q_and_o = 2 * m.hidden_size * m.num_heads * m.head_dim
        k_and_v = 2 * m.hidden_size * m.num_kv_heads * m.head_dim
        mlp = 3 * m.hidden_size * m.intermediate_size
        return cls(linear_params=m.num_layers * (q_and_o + k_and_v + mlp),
                   lm_head_params=m.vocab_size * m.hidden_size,
                   kv_bytes_per_token=2 * m.num_layers * m.num_kv_heads * m.head_dim
                   * bytes_per_param,
                   attn_flops_per_pair=4 * m.num_layers * m.num_heads * m.head_dim,
                   bytes_per_param=bytes_per_param)

    def step_bytes(self, step: StepRecord) -> float:
        weights = self.linear_params + (self.lm_head_params if step.num_logits else 0)
        kv_tokens = sum(c + n for c, n in step.seqs)
        return weights * self.bytes_per_param + kv_tokens * self.kv_bytes_per_token

    def step_flops(self, step: StepRecord) -> float:
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in step.seqs)
        return (2 * self.linear_params * step.num_tokens + 2 * self.lm_head_params
                * step.num_logits + self.attn_flops_per_pair * pairs)

    def step_limit_s(self, step: StepRecord, read_gbps: float, matmul_gflops: float) -> float:
        return max(self.step_bytes(step) / (read_gbps * 1e9),
                   self.step_flops(step) / (matmul_gflops * 1e9))


def measure_machine(model: ModelConfig, when: str) -> Dict[str, float]:
    square, shaped = measure_matmul_gflops(model)
    machine = {"read_gbps": measure_read_gbps(), "mm2048_gflops": square,
               "linear_gflops": shaped}
    print(f"machine {when} ({torch.get_num_threads()} torch threads, load average "
          f"{os.getloadavg()[0]:.1f}): read {machine['read_gbps']:.1f} GB/s (1 GiB sum), fp32 "
          f"matmul {square:.1f} GFLOP/s (2048^3), {shaped:.1f} GFLOP/s (model-shaped linear), "
          f"each the better of torch's BLAS and oneDNN",
          flush=True)
    return machine


def best_machine(first: Dict[str, float], last: Dict[str, float]) -> Dict[str, float]:
    """The machine's limit is its best: take each rate's maximum over both measurements."""
    best = {k: max(first[k], last[k]) for k in first}
    best["matmul_gflops"] = max(best["mm2048_gflops"], best["linear_gflops"])
    print(f"the limit uses read {best['read_gbps']:.1f} GB/s and matmul "
          f"{best['matmul_gflops']:.1f} GFLOP/s (the best of both measurements)")
    return best
