"""Constrained requests through `AsyncLLMEngine`: grammars compile on a pool, never on the
engine thread, within the compile time limit; compile errors reach the caller only."""

import asyncio
import dataclasses
import json
import threading

import pytest

from workers.async_engine import AsyncLLMEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams
from workers.structured.spec import StructuredOutput

SCHEMA = json.dumps({"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"], "additionalProperties": False})


@pytest.fixture(scope="module")
def engine(smollm2_tiny):
    eng = AsyncLLMEngine(lambda: LLMEngine(EngineConfig(model=str(smollm2_tiny),
                                                        num_kv_blocks=64, max_model_len=256)))
    yield eng
    eng.shutdown()


def constrained(kind, spec="", **extra):
    return SamplingParams(max_tokens=64, temperature=0.0, **extra,
                          structured=StructuredOutput(kind, spec, any_whitespace=False))


async def final(engine, prompt, params, request_id):
    return [o async for o in engine.generate(prompt, params, request_id)][-1]


def test_grammars_compile_off_the_engine_thread(engine, monkeypatch):
    structured = engine.engine.structured
    compile_threads = []
    real_compile = structured.compile

    def recording_compile(spec):
        compile_threads.append(threading.current_thread())
        return real_compile(spec)

    monkeypatch.setattr(structured, "compile", recording_compile)

    async def main():
        return await asyncio.gather(
            final(engine, "hi", constrained("json_schema", SCHEMA), "a1"),
            final(engine, "hello", constrained("regex", "[a-c]{2,5}"), "a2"))

    outs = asyncio.run(main())
    assert [o.finish_reason for o in outs] == ["stop", "stop"]
    assert set(json.loads(outs[0].text)) == {"ok", "n"}
    assert len(compile_threads) == 2
    assert engine._thread not in compile_threads
    assert all(t.name.startswith("tpserve-grammar") for t in compile_threads)


@pytest.mark.parametrize("params, match", [
    (constrained("regex", "[z-a]"), "the regex does not compile"),
    (constrained("json_object", ignore_eos=True), "ignore_eos cannot be combined"),
])
def test_refused_specs_raise_to_the_caller_only(engine, params, match):
    async def main():
        with pytest.raises(ValueError, match=match):
            await final(engine, "hi", params, "bad")
        return await final(engine, "hi", SamplingParams(max_tokens=3), "good")

    assert asyncio.run(main()).finished
    assert engine.is_alive and not engine._streams


def test_a_compile_past_the_time_limit_is_refused(engine, monkeypatch):
    limited = dataclasses.replace(engine.engine.config, grammar_compile_timeout_s=1e-4)
    monkeypatch.setattr(engine.engine, "config", limited)
    schema = json.dumps({"type": "object", "properties": {
        f"field{i}": {"type": "string", "maxLength": 5 + i} for i in range(12)}})

    async def main():
        with pytest.raises(ValueError, match=r"json_schema took longer than 0.0001 s to "
                                             r"compile"):
            await final(engine, "hi", constrained("json_schema", schema), "slow")

    asyncio.run(main())
    assert engine.is_alive and not engine._streams
