"""The detokenizer's window stays a few tokens long whatever the output: across special tokens
skipped in decoding and across long runs of bytes that never make a character; and it gives the
same deltas as the detokenizer before (``ReferenceDetokenizer``, whose window grew)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripts.bench_detokenizer import ReferenceDetokenizer
from workers.detokenizer import IncrementalDetokenizer
from workers.tokenizer import load_tokenizer

PROMPT = "the quick brown fox"
MAX_WINDOW = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def feed(tokenizer, token_ids: List[int]) -> List[int]:
    """Feed ``token_ids``; the window each step decoded. Checks the text against a full decode."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    windows = []
    for token_id in token_ids:
        windows.append(detok.num_window_ids)
        detok.add_token(token_id)
    detok.flush()
    assert detok.text == tokenizer.decode(token_ids, skip_special_tokens=True)
    return windows


def test_special_tokens_skipped_in_decoding_do_not_grow_the_window(tokenizer):
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([eos], skip_special_tokens=True) == ""
    ids = tokenizer.encode("Hello") + [eos] * 300 + tokenizer.encode(" world")
    assert max(feed(tokenizer, ids)) <= MAX_WINDOW


def test_a_long_run_of_bytes_that_make_no_character_does_not_grow_the_window(tokenizer):
    # A byte that never starts nor continues a character: each one decodes to U+FFFD, and the
    # text ends in U+FFFD (maybe the start of a character) all along the run.
    byte = next(i for i in range(len(tokenizer))
                if tokenizer.decode([i, i]) == "\ufffd\ufffd")
    ids = tokenizer.encode("Hello") + [byte] * 300 + tokenizer.encode(" world")
    assert max(feed(tokenizer, ids)) <= MAX_WINDOW


def run(cls, tokenizer, token_ids: Sequence[int], stop: Sequence[str], include: bool,
        min_tokens: int) -> Tuple[List[str], str, bool]:
    """The deltas (the flush's last), the text and whether a stop matched, as the engine feeds."""
    detok = cls(tokenizer, tokenizer.encode(PROMPT), stop, include_stop_str_in_output=include)
    deltas = []
    for count, token_id in enumerate(token_ids, start=1):
        delta, stopped = detok.add_token(token_id, can_stop=count > min_tokens)
        deltas.append(delta)
        if stopped:
            return deltas, detok.text, True
    deltas.append(detok.flush())
    return deltas, detok.text, False


def byte_token_ids(tokenizer) -> List[int]:
    """The id of each byte's token, in byte order (GPT-2's byte-to-character map)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, num_unprintable = [], 0
    for byte in range(256):
        chars.append(chr(byte) if byte in printable else chr(256 + num_unprintable))
        num_unprintable += byte not in printable
    return tokenizer.convert_tokens_to_ids(chars)


ALPHABET = "ab U:s\n\u00e9\u20ac\U0001f642"


@st.composite
def outputs(draw, tokenizer) -> List[int]:
    """Token ids in runs: text, special tokens, bytes of 0x80 and up (rarely a character), any
    ids; stop strings are then cut from what they decode to."""
    byte_ids = byte_token_ids(tokenizer)
    specials = sorted(tokenizer.all_special_ids)
    runs = st.one_of(
        st.text(ALPHABET, min_size=1, max_size=6).map(tokenizer.encode),
        st.lists(st.sampled_from(specials), min_size=1, max_size=12),
        st.lists(st.integers(0x80, 0xFF).map(byte_ids.__getitem__), min_size=1, max_size=16),
        st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=8))
    return [t for run in draw(st.lists(runs, max_size=8)) for t in run]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), include=st.booleans(), min_tokens=st.sampled_from([0, 0, 3, 20]))
def test_the_text_and_every_delta_are_the_reference_ones(tokenizer, data, include, min_tokens):
    token_ids = data.draw(outputs(tokenizer))
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    stop = data.draw(st.lists(
        st.tuples(st.integers(0, len(full)), st.integers(1, 4)).map(
            lambda at: full[at[0]:at[0] + at[1]]).filter(bool), max_size=3))
    ours = run(IncrementalDetokenizer, tokenizer, token_ids, stop, include, min_tokens)
    assert ours == run(ReferenceDetokenizer, tokenizer, token_ids, stop, include, min_tokens)
    deltas, text, _ = ours
    assert "".join(deltas) == text
    if not stop:
        assert text == full
