"""The detokenizer's window stays a few tokens long whatever the output: across special tokens
skipped in decoding and across long runs of bytes that never make a character."""

from __future__ import annotations

from typing import List

import pytest

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
