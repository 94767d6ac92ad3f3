"""Offline API: submit every prompt at once (so they are batched), step until all finish."""

from __future__ import annotations

from typing import List, Sequence, Union

from workers.config import EngineConfig
from workers.engine import LLMEngine, RequestOutput
from workers.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]


class LLM:
    """``LLM(EngineConfig(model=...)).generate(prompts, params)`` -> outputs in prompt order
    (a prompt whose params ask for ``n`` choices gives ``n`` outputs in a row, by ``index``).
    ``bind_cpu_cores``: CPU ranks, this process included, run on cores of their own
    (`parallel.cpu_binding`): for a process that does nothing else."""

    def __init__(self, config: EngineConfig, bind_cpu_cores: bool = False) -> None:
        self.engine = LLMEngine(config, bind_cpu_cores=bind_cpu_cores)

    def generate(self, prompts: Sequence[Prompt],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> List[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict = {}
        while self.engine.has_unfinished():
            self.engine.wait_while_idle()  # only spills held back by their bound left
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        return [final[rid, index] for rid, sp in zip(ids, params) for index in range(sp.n)]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
