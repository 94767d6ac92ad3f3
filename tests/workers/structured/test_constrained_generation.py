"""Constrained decoding end to end on a tiny random Llama with the default model's real
tokenizer: every output of a random model matches its constraint and ends with ``stop``."""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from workers.config import EngineConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.structured.matcher import RequestGrammar
from workers.structured.spec import StructuredOutput

EOS = 2
PROMPTS = ["Reply in JSON:", "hello world", "the answer is"]


@pytest.fixture(scope="module")
def llm(smollm2_tiny):
    with LLM(EngineConfig(model=str(smollm2_tiny), block_size=16, num_kv_blocks=256,
                          max_model_len=1024)) as engine:
        yield engine


def constrained(kind, spec="", choices=(), **params):
    params.setdefault("max_tokens", 256)
    params.setdefault("temperature", 0.0)
    return SamplingParams(structured=StructuredOutput(kind, spec, tuple(choices),
                                                      any_whitespace=False), **params)


def schema_of(properties):
    return {"type": "object", "properties": properties, "required": sorted(properties),
            "additionalProperties": False}


# Bounded schemas: every one has a longest output, which a random model reaches well within
# max_tokens, so each output can be checked to complete.
_NAMES = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-100, 100), st.integers(0, 1000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.text("abcxyz -", min_size=1, max_size=5), min_size=1, max_size=4,
             unique=True).map(lambda values: {"enum": values}),
)


def _nested(children):
    return st.one_of(
        st.dictionaries(_NAMES, children, min_size=1, max_size=3).map(schema_of),
        children.map(lambda items: {"type": "array", "items": items, "maxItems": 2}))


SCHEMAS = st.dictionaries(_NAMES, st.recursive(_LEAVES, _nested, max_leaves=6),
                          min_size=1, max_size=4).map(schema_of)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=3, max_size=3), seed=st.integers(0, 2**31))
def test_random_schemas_give_outputs_that_validate(llm, schemas, seed):
    """Nine random schemas, three at a time in one batch, sampled at temperature 1."""
    params = [constrained("json_schema", json.dumps(schema), max_tokens=400, temperature=1.0,
                          seed=seed + i) for i, schema in enumerate(schemas)]
    outs = llm.generate(["Reply in JSON:"] * len(params), params)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        assert out.output_token_ids[-1] == EOS
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_json_object(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( ok)?"
    choices = ("yes", "no", "maybe so", "a.b|c")
    # A random model writes JSON strings forever: a bias towards '"' makes them short.
    short_strings = {llm.engine.tokenizer.convert_tokens_to_ids('"'): 12.0}
    params = [constrained("regex", regex), constrained("regex", regex, temperature=1.0, seed=1),
              constrained("choice", choices=choices),
              constrained("choice", choices=choices, temperature=1.0, seed=2)] + [
              constrained("json_object", temperature=1.0, seed=seed, logit_bias=short_strings)
              for seed in range(2, 5)]
    outs = llm.generate(["the answer is"] * len(params), params)
    assert all(out.finish_reason == "stop" for out in outs), [o.text for o in outs]
    assert all(re.fullmatch(regex, out.text) for out in outs[:2])
    assert all(out.text in choices for out in outs[2:4])
    objects = [json.loads(out.text) for out in outs[4:]]
    assert all(isinstance(value, dict) for value in objects) and any(objects), objects


GRAMMAR = r'''
root ::= "(" expr ")"
expr ::= term (("+" | "*") term){0,3}
term ::= [1-9] | "x" | "(" [a-c] ")"
'''


def test_ebnf_output_is_accepted_by_a_fresh_matcher(llm):
    params = constrained("grammar", GRAMMAR, temperature=1.0, seed=7, n=3)
    outs = llm.generate(["hello world"], params)
    compiled = llm.engine.structured.compile(params.structured)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        fresh = RequestGrammar(compiled, params.structured)
        assert all(fresh.accept(t) for t in out.output_token_ids) and fresh.is_terminated
        assert re.fullmatch(r"\((?:[1-9x]|\([a-c]\))(?:[+*](?:[1-9x]|\([a-c]\))){0,3}\)",
                            out.text), out.text


def test_logprobs_are_those_of_the_raw_model_output(llm):
    out = llm.generate(["hi"], constrained("choice", choices=("yes",), logprobs=3))[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    # Each token was the only one allowed: masked logprobs would all be 0.
    assert all(entry.logprob < -1.0 for entry in out.logprobs)
    assert any(entry.top_logprobs[0][0] != token
               for entry, token in zip(out.logprobs, out.output_token_ids))


def test_a_spec_that_does_not_compile_is_refused_at_add_request(llm):
    with pytest.raises(ValueError, match="the regex does not compile"):
        llm.engine.add_request("hi", constrained("regex", "[a-"))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("field, value", [("ignore_eos", True), ("min_tokens", 2)])
def test_fields_that_hold_back_the_stop_token_are_refused_by_name(llm, field, value):
    with pytest.raises(ValueError, match=f"{field} cannot be combined with a json_object"):
        llm.engine.add_request("hi", constrained("json_object", **{field: value}))


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(llm):
    plain = [SamplingParams(max_tokens=12, temperature=0.0),
             SamplingParams(max_tokens=12, temperature=0.8, seed=11)]
    alone = llm.generate(PROMPTS[:2], plain)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS, plain + [
        constrained("json_object"), constrained("regex", "[a-z ]{1,20}"),
        constrained("choice", choices=("one", "two"))])
    assert [o.output_token_ids for o in mixed[:2]] == [o.output_token_ids for o in alone]
    assert llm.engine.structured._bitmask is not None  # the mixed batch was masked


def test_seeded_constrained_sampling_is_reproducible_in_any_batch(llm):
    params = constrained("regex", "[a-z]{3,12}( [0-9]{1,3}){0,2}", temperature=1.0, seed=1234,
                         n=2)
    alone = llm.generate(["hello world"], params)
    crowded = llm.generate(PROMPTS + ["hello world"],
                           [constrained("regex", "[a-z]{5,9}", temperature=1.0)] * 3 + [params])
    assert [o.output_token_ids for o in crowded[3:]] == [o.output_token_ids for o in alone]
    assert alone[0].output_token_ids != alone[1].output_token_ids  # choices draw their own


def test_a_resumed_constrained_request_continues_exactly(llm):
    schema = json.dumps(schema_of({"name": {"type": "string", "maxLength": 12},
                                   "n": {"type": "integer", "minimum": 0, "maximum": 99}}))
    params = constrained("json_schema", schema)
    full = llm.generate(["Reply in JSON:"], params)[0].output_token_ids
    cut = len(full) // 2
    rid = llm.engine.add_request("Reply in JSON:", params, resume_output_ids=full[:cut])
    rest = []
    while llm.engine.has_unfinished():
        rest += [t for o in llm.engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert full[:cut] + rest == full


def test_a_resumed_token_the_grammar_refuses_is_named(llm, smollm2_tiny):
    bad = llm.engine.tokenizer.encode("x")[0]
    with pytest.raises(ValueError, match=rf"resume_output_ids\[0\] = {bad} is not allowed"):
        llm.engine.add_request("hi", constrained("json_object"), resume_output_ids=[bad])
    assert not llm.engine.has_unfinished()


def test_aborted_requests_release_their_matchers(llm):
    rid = llm.engine.add_request("hi", constrained("regex", "[a-z]{50}", n=2))
    llm.engine.step()
    choices = list(llm.engine._requests[rid])
    assert all(c.grammar is not None for c in choices)
    llm.engine.abort(rid)
    outs = llm.engine.step()
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert all(c.grammar is None for c in choices)


def test_unconstrained_engines_never_build_a_compiler(smollm2_tiny):
    with LLM(EngineConfig(model=str(smollm2_tiny), num_kv_blocks=64)) as fresh:
        fresh.generate(["hi"], SamplingParams(max_tokens=3))
        assert fresh.engine.structured._cache is None
        assert fresh.engine.structured._bitmask is None
