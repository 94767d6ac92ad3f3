"""The grammar of a ``required`` or named tool choice (cluster/api/tools/grammar.py), compiled by
xgrammar for a real tokenizer of each family: token sequences drawn at random among the tokens
it allows (as a sampler under its mask would), detokenized as the engine does, always parse into
calls of the allowed functions whose arguments validate against their schemas."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from transformers import AutoTokenizer  # noqa: E402

from cluster.api.tools.definitions import FunctionDefinition  # noqa: E402
from cluster.api.tools.formats import FORMATS, MISTRAL  # noqa: E402
from cluster.api.tools.plan import ChoiceTools, ToolPlan  # noqa: E402
from cluster.api.tools.grammar import tool_grammar  # noqa: E402

VOCAB_SIZE = 509  # the tiny checkpoints' (beyond the tokenizer's: never allowed)
MAX_STEPS = 400
FUNCTIONS = [
    FunctionDefinition(name="get_weather", parameters={
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Rome"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}),
    FunctionDefinition(name="ping", parameters={
        "type": "object", "properties": {}, "additionalProperties": False}),
]
SCHEMAS = {f.name: f.parameters for f in FUNCTIONS}
# The tokenizer each format is tested with; Mistral's is the Qwen one plus [TOOL_CALLS] as a
# special token (dropped by the detokenizer, put back by the choice's parser).
FAMILY = {"hermes": "qwen2", "llama3_json": "llama3", "mistral": "qwen2"}


@pytest.fixture(scope="module")
def tokenizers(tool_checkpoints, tmp_path_factory):
    loaded = {fam: AutoTokenizer.from_pretrained(str(tool_checkpoints(fam)))
              for fam in ("qwen2", "llama3")}
    mistral = AutoTokenizer.from_pretrained(str(tool_checkpoints("qwen2")))
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    loaded["mistral"] = mistral
    return loaded


def random_output(compiled, tokenizer, plan, rng):
    """Tokens drawn uniformly among those the grammar allows (the stop token, once allowed,
    half the time), fed to a choice's parser as the engine's chunks are; the parsed output and
    whether the grammar ended."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    choice = ChoiceTools(plan)
    stop_ids = set(matcher.stop_token_ids)
    for _ in range(MAX_STEPS):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:VOCAB_SIZE]).tolist()
        stops = [t for t in allowed if t in stop_ids]
        token = rng.choice(stops) if stops and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return choice.result(), True
        choice.add(tokenizer.decode([token], skip_special_tokens=True), [token])
    return choice.result(), False


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("named,parallel", [(None, True), (None, False), ("get_weather", True)])
def test_what_the_grammar_allows_parses_into_valid_calls(tokenizers, fmt_name, named, parallel):
    fmt = FORMATS[fmt_name]
    tokenizer = tokenizers[FAMILY[fmt_name]]
    marker_id = (tokenizer.convert_tokens_to_ids(fmt.opens[0]) if fmt is MISTRAL else None)
    structured = tool_grammar(fmt, FUNCTIONS, named, parallel, marker_is_token=bool(marker_id))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE)
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(structured.spec)
    plan = ToolPlan(fmt, structured, marker_id)
    rng = random.Random(f"{fmt_name}-{named}-{parallel}")
    num_ended = 0
    for _ in range(6):
        parsed, ended = random_output(compiled, tokenizer, plan, rng)
        num_ended += ended
        if not ended:
            continue
        assert parsed.content is None and parsed.calls
        if named or not parallel:
            assert len(parsed.calls) == 1
        for call in parsed.calls:
            assert call.name in SCHEMAS and (named is None or call.name == named)
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert num_ended >= 3


def test_the_grammar_refuses_text_and_other_functions(tokenizers):
    fmt = FORMATS["hermes"]
    info = xgr.TokenizerInfo.from_huggingface(tokenizers["qwen2"], vocab_size=VOCAB_SIZE)
    compiler = xgr.GrammarCompiler(info)
    named = compiler.compile_structural_tag(tool_grammar(fmt, FUNCTIONS, "ping", True).spec)
    required = compiler.compile_structural_tag(tool_grammar(fmt, FUNCTIONS, None, True).spec)
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    weather = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
               '\n</tool_call>')
    assert xgr.GrammarMatcher(named).accept_string(ping)
    assert not xgr.GrammarMatcher(named).accept_string(weather)
    assert xgr.GrammarMatcher(required).accept_string(weather + "\n" + ping)
    assert not xgr.GrammarMatcher(required).accept_string("Sure! " + ping)
    bad_args = weather.replace('"days": 2', '"days": 9')
    assert not xgr.GrammarMatcher(required).accept_string(bad_args)
