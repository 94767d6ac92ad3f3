"""Incremental detokenization on the test checkpoint's byte-level BPE tokenizer: stop strings never
reach the stream, the deltas add up to the final text, characters split over tokens come whole."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.detokenizer import IncrementalDetokenizer
from workers.tokenizer import load_tokenizer

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return load_tokenizer(tiny_llama)


def stream(tokenizer, token_ids: Sequence[int], stop: Sequence[str] = (),
           include: bool = False) -> Tuple[List[str], str, bool]:
    """Feed ``token_ids`` one by one as the engine does, stopping where the detokenizer says;
    flush at the end otherwise. Returns the deltas, the final text and whether a stop matched."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), stop,
                                   include_stop_str_in_output=include)
    deltas = []
    for token_id in token_ids:
        delta, stopped = detok.add_token(token_id)
        deltas.append(delta)
        if stopped:
            return deltas, detok.text, True
    deltas.append(detok.flush())
    return deltas, detok.text, False


def test_a_stop_string_split_over_tokens_is_never_streamed(tokenizer):
    ids = tokenizer.encode("Hello User:")
    assert tokenizer.decode(ids[-1:]) == ":"  # "User" is out before ":" shows it is a stop
    deltas, text, stopped = stream(tokenizer, ids, stop=("User:",))
    assert stopped and text == "Hello " and "".join(deltas) == "Hello "
    assert not any("U" in d for d in deltas)


def test_held_text_is_released_once_it_cannot_start_a_stop_string(tokenizer):
    ids = tokenizer.encode("Hello Users")
    deltas, text, stopped = stream(tokenizer, ids, stop=("User:",))
    assert not stopped and text == "Hello Users" and "".join(deltas) == text
    # "User" was held until "s" showed it is no stop; the flush then had nothing left.
    assert deltas[-2:] == ["Users", ""]


def test_the_flush_releases_text_held_for_a_stop_that_never_came(tokenizer):
    deltas, text, stopped = stream(tokenizer, tokenizer.encode("Hello User"), stop=("User:",))
    assert not stopped and text == "Hello User"
    assert deltas[-1] == "User"


def test_include_stop_str_in_output_cuts_right_after_the_stop(tokenizer):
    deltas, text, stopped = stream(tokenizer, tokenizer.encode("Hello User: and more"),
                                   stop=("User:",), include=True)
    assert stopped and text == "Hello User:" and "".join(deltas) == text


@pytest.mark.parametrize("stop, expected", [
    (("Hello User:", "lo U"), "Hel"),  # "lo U" completes while the other is still a prefix
    (("Hello", "ll"), "He"),  # both complete in the token "llo"; "ll" does first
])
def test_the_stop_string_that_completes_first_wins(tokenizer, stop, expected):
    assert tokenizer.decode(tokenizer.encode("Hello")[-1:]) == "llo"
    deltas, text, stopped = stream(tokenizer, tokenizer.encode("Hello User:"), stop=stop)
    assert stopped and text == expected and "".join(deltas) == text


@pytest.mark.parametrize("stop", [(), ("\U0001f642!",)])
def test_a_character_split_over_byte_tokens_is_emitted_whole(tokenizer, stop):
    ids = tokenizer.encode("ok \U0001f642?")
    assert len(ids) >= 5  # the emoji's four UTF-8 bytes are separate tokens
    deltas, text, stopped = stream(tokenizer, ids, stop=stop)
    assert not stopped and text == "ok \U0001f642?" and "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def _expected(full: str, stop: Sequence[str], include: bool) -> Tuple[str, bool]:
    """``full`` cut at the stop string that completes first (the longest among those ending
    there), before it or, with ``include``, right after it."""
    hits = [(full.find(s) + len(s), full.find(s)) for s in stop if s in full]
    if not hits:
        return full, False
    end, start = min(hits)
    return full[:end] if include else full[:start], True


ALPHABET = "ab U:s\n\u00e9\U0001f642"


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=8),
       stop=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
       include=st.booleans())
def test_deltas_add_up_to_the_text_cut_at_the_first_stop(tokenizer, chunks, stop, include):
    # Encoding each chunk on its own splits the same text into tokens at random places.
    ids = [t for chunk in chunks for t in tokenizer.encode(chunk)]
    full = "".join(chunks)
    deltas, text, stopped = stream(tokenizer, ids, stop, include)
    assert "".join(deltas) == text
    assert (text, stopped) == _expected(full, stop, include)
    # A stop string shows only at the very end, and only when asked for.
    assert not any(s in (text[:-1] if include else text) for s in stop)
    assert not any("\ufffd" in d for d in deltas)
