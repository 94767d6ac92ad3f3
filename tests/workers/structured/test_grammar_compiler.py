"""`workers.structured.compiler` and `matcher` on the default model's real tokenizer: what
compiles, what is refused and how, the cache's bound, the masks of a padded vocabulary."""

import json
import re

import pytest
import torch

from workers.structured.compiler import GrammarCache, choice_regex
from workers.structured.matcher import RequestGrammar, fill_masks
from workers.structured.spec import StructuredOutput
from workers.tokenizer import load_tokenizer

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(smollm2_tiny):
    return load_tokenizer(smollm2_tiny)


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer, len(tokenizer), [EOS])


def complete_with(grammar: RequestGrammar, tokenizer, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens and then the stop token and is complete."""
    return (all(grammar.accept(t) for t in tokenizer.encode(text)) and grammar.accept(EOS)
            and grammar.is_terminated)


@pytest.mark.parametrize("kind, spec, match", [
    ("regex", "(abc", r"^the regex does not compile: .*parenthesis"),
    ("grammar", "root ::= undefined_rule", r"^the grammar does not compile: .*undefined_rule"),
    ("grammar", 'start ::= "a"', r"^the grammar does not compile: .*root"),
    ("json_schema", '{"type": "no-such-type"}', r"^the json_schema does not compile: .*no-such"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nonsense"}}',
     r"^the structural_tag does not compile: "),
])
def test_a_spec_that_does_not_compile_is_a_value_error_naming_kind_and_reason(
        cache, kind, spec, match):
    with pytest.raises(ValueError, match=match) as info:
        cache.compile(StructuredOutput(kind, spec))
    assert "/project/cpp" not in str(info.value)  # xgrammar's source location is dropped


def test_choices_are_taken_literally(cache, tokenizer):
    choices = ("a.b", "c|d", "(x)*", "1+1=2", "[no]", "tab\there", "back\\slash", "{}?^$",
               "x-y/z", "café ☕")
    assert all(re.fullmatch(choice_regex(choices), choice) for choice in choices)
    compiled = cache.compile(StructuredOutput("choice", choices=choices))
    for choice in choices:
        assert complete_with(RequestGrammar(compiled, None), tokenizer, choice), choice
    for near_miss in ("aXb", "c", "d", "x", "(x)", "1+1", "no", "{}", "x-y", "cafe ☕"):
        assert not complete_with(RequestGrammar(compiled, None), tokenizer, near_miss), near_miss


def test_any_whitespace_false_allows_only_the_compact_form(cache, tokenizer):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False})
    compact = cache.compile(StructuredOutput("json_schema", schema, any_whitespace=False))
    loose = cache.compile(StructuredOutput("json_schema", schema, any_whitespace=True))
    spaced = '{ "a" :   1 }'
    assert not complete_with(RequestGrammar(compact, None), tokenizer, spaced)
    assert complete_with(RequestGrammar(loose, None), tokenizer, spaced)


def test_compiles_are_cached_by_spec_and_bounded_in_bytes(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), [EOS])
    first = cache.compile(StructuredOutput("regex", "[a-z]{3}"))
    assert cache.compile(StructuredOutput("regex", "[a-z]{3}")) is first
    size = first.memory_size_bytes
    small = GrammarCache(tokenizer, len(tokenizer), [EOS], max_bytes=int(size * 2.5))
    for n in range(1, 6):
        small.compile(StructuredOutput("regex", f"[a-z]{{{n}}}"))
        assert small.num_bytes <= small.max_bytes
    assert 1 <= len(small) <= 2
    assert small.compile(StructuredOutput("regex", "[a-z]{5}")) is small.compile(
        StructuredOutput("regex", "[a-z]{5}"))  # the newest stayed


def test_no_tokenizer_is_refused_by_name():
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarCache(None, 100, [EOS])


def test_a_padded_vocabulary_never_allows_the_padding(tokenizer):
    vocab = len(tokenizer)
    padded = GrammarCache(tokenizer, vocab + 64, [EOS])
    compiled = padded.compile(StructuredOutput("json_object"))
    grammar = RequestGrammar(compiled, None)
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(2, vocab + 64)
    mask = fill_masks([None, grammar], bitmask, vocab + 64)
    logits = torch.zeros(2, vocab + 100)  # [2, V'] wider still than the mask
    mask.apply(logits)
    assert torch.isinf(logits[1, vocab:]).all()  # ids past the tokenizer's: never allowed
    assert (logits[0] == 0).all()  # the unconstrained row untouched
    allowed = torch.nonzero(logits[1] == 0).flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
