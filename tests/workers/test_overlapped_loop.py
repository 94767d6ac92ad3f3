"""The overlapped step loop (``--async-scheduling``) on a tiny real checkpoint: the same tokens,
texts and finish reasons as the serial loop, whatever ends or interrupts the requests."""

import pytest

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0)


def config(model_dir, overlap, **overrides):
    values = dict(model=str(model_dir), block_size=4, num_kv_blocks=128, dtype="float32",
                  async_scheduling=overlap)
    values.update(overrides)
    return EngineConfig(**values)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    serial, overlapped = LLMEngine(config(tiny_llama, False)), LLMEngine(config(tiny_llama, True))
    yield serial, overlapped
    serial.shutdown()
    overlapped.shutdown()


def run_all(engine, requests, abort_after=None):
    """Submit ``requests`` ((prompt, params, extra add_request kwargs) by id) at once, step to
    the end; per (id, choice): the summed new ids and deltas and the last output. With
    ``abort_after`` (id, calls): that request is aborted after that many steps."""
    for rid, (prompt, params, extra) in requests.items():
        engine.add_request(prompt, params, request_id=rid, **extra)
    streams, calls = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            ids, text, _ = streams.get((out.request_id, out.index), ([], "", None))
            streams[out.request_id, out.index] = (ids + out.new_token_ids, text + out.delta_text,
                                                  out)
        calls += 1
        if abort_after is not None and calls == abort_after[1]:
            engine.abort(abort_after[0])
    return {key: (ids, text, out.output_token_ids, out.text, out.finish_reason,
                  [round(t.logprob, 4) for t in out.logprobs])
            for key, (ids, text, out) in streams.items()}


def mixed_requests(stop_token, stop_string):
    seeded = dict(temperature=0.9, top_p=0.9)
    return {
        "greedy": ([5, 6, 7, 8, 9], SamplingParams(max_tokens=17, **GREEDY), {}),
        "short": ([11, 3], SamplingParams(max_tokens=1, **GREEDY), {}),
        "stop-token": ([5, 6, 7, 8, 9], SamplingParams(max_tokens=30, stop_token_ids=(
            stop_token,), **GREEDY), {}),
        "stop-string": ([5, 6, 7, 8, 9], SamplingParams(max_tokens=30, stop=(stop_string,),
                                                        **GREEDY), {}),
        "seeded": ([40, 41, 42], SamplingParams(max_tokens=12, seed=7, **seeded), {}),
        "choices": ([60, 61], SamplingParams(max_tokens=9, n=2, seed=3, **seeded), {}),
        "logprobs": ([70, 71, 72], SamplingParams(max_tokens=6, logprobs=2, **GREEDY), {}),
        "penalty": ([5, 6, 5, 6], SamplingParams(max_tokens=10, repetition_penalty=1.3,
                                                 presence_penalty=0.5, **GREEDY), {}),
        "resumed": ([80, 81, 82], SamplingParams(max_tokens=8, **GREEDY),
                    {"resume_output_ids": [83, 84, 85]}),
    }


def test_a_mixed_batch_gets_the_serial_loops_tokens_texts_and_reasons(engines):
    serial, overlapped = engines
    probe = run_all(serial, {"p": ([5, 6, 7, 8, 9], SamplingParams(max_tokens=30, **GREEDY),
                                   {})})[("p", 0)]
    ids, text = probe[2], probe[3]
    printable = next(i for i in range(3, len(text) - 2) if text[i:i + 2].isprintable())
    requests = mixed_requests(ids[6], text[printable:printable + 2])
    expected = run_all(serial, requests)
    got = run_all(overlapped, requests)
    assert got == expected
    assert expected["stop-token", 0][4] == "stop" and expected["stop-string", 0][4] == "stop"
    for (rid, _), (ids, text, final_ids, final_text, _, _) in got.items():
        if rid != "resumed":  # its outputs start with the tokens it resumed from
            assert ids == final_ids and text == final_text  # the stream adds up


def test_outputs_come_one_step_later_and_no_slot_is_spent_past_max_tokens(tiny_llama):
    """The overlapped loop hands out a step's tokens after launching the next; a request whose
    last token is pending is not scheduled again, so length-bound requests compute exactly what
    the serial loop computes."""
    prompts = {f"r{i}": ([5 + i, 6, 7], SamplingParams(max_tokens=4 + i, **GREEDY), {})
               for i in range(3)}
    computed = []
    for overlap in (False, True):
        with LLMEngine(config(tiny_llama, overlap, record_steps=True)) as engine:
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
            first = engine.step()
            assert bool(first) != overlap  # serial: the first tokens now; overlapped: next call
            run_all(engine, prompts)
            computed.append(sum(r.num_tokens for r in engine.step_records))
            assert engine.kv_usage().num_used_blocks == 0
    assert computed[0] == computed[1]


def test_an_abort_mid_stream_keeps_a_prefix_and_frees_the_blocks(engines):
    serial, overlapped = engines
    requests = {"a": ([5, 6, 7], SamplingParams(max_tokens=20, **GREEDY), {}),
                "b": ([9, 8, 7], SamplingParams(max_tokens=12, **GREEDY), {})}
    expected = run_all(serial, requests)
    got = run_all(overlapped, requests, abort_after=("a", 4))
    assert got["b", 0] == expected["b", 0]
    ids, _, final_ids, _, reason, _ = got["a", 0]
    assert reason == "abort" and ids == final_ids
    assert 0 < len(final_ids) < 20 and final_ids == expected["a", 0][2][:len(final_ids)]
    assert overlapped.kv_usage().num_used_blocks == 0


def test_preemption_chunked_prefill_and_prefix_hits_give_the_serial_tokens(tiny_llama):
    """A pool too small for every request at once (preemption by recompute), prompts longer than
    a step's budget (chunked prefill), and a shared prefix (prefix cache hits)."""
    shared = list(range(20, 36))
    requests = {f"r{i}": (shared + [40 + i] * (3 + i), SamplingParams(max_tokens=14, **GREEDY),
                          {}) for i in range(4)}
    results, preemptions, hits = [], [], []
    for overlap in (False, True):
        with LLMEngine(config(tiny_llama, overlap, num_kv_blocks=22,
                              max_num_batched_tokens=12)) as engine:
            results.append(run_all(engine, requests))
            preemptions.append(engine.scheduler.num_preemptions)
            hits.append(engine.scheduler.kv.num_prefix_hits)
    assert results[1] == results[0]
    assert min(preemptions) > 0 and min(hits) > 0


@pytest.mark.multiproc
def test_two_ranks_take_the_sampled_ids_from_the_device(tiny_llama, engines):
    """TP 2: rank 1 gets each step's sampled ids by a broadcast over the device group (gloo
    here), never through the plan; the tokens equal one serial rank's."""
    serial, _ = engines
    requests = {f"r{i}": ([5 + i, 6, 7, 8], SamplingParams(max_tokens=9 + i, **GREEDY), {})
                for i in range(3)}
    expected = run_all(serial, requests)
    with LLMEngine(config(tiny_llama, True, tp_size=2)) as engine:
        assert run_all(engine, requests) == expected
