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


def run(cls, tokenizer, token_ids: Sequence[int], stop: Sequence[str] = (), include: bool = False,
        min_tokens: int = 0, prompt: str = PROMPT) -> Tuple[List[str], str, bool]:
    """The deltas (the flush's last), the text and whether a stop matched, as the engine feeds."""
    detok = cls(tokenizer, tokenizer.encode(prompt), stop, include_stop_str_in_output=include)
    deltas = []
    for count, token_id in enumerate(token_ids, start=1):
        delta, stopped = detok.add_token(token_id, can_stop=count > min_tokens)
        deltas.append(delta)
        if stopped:
            return deltas, detok.text, True
    deltas.append(detok.flush())
    return deltas, detok.text, False


def byte_token_ids(tokenizer) -> List[int]:
    """The id of each byte's token, in byte order: byte-fallback tokens (``<0x41>``) or GPT-2's
    byte-to-character map of byte-level BPE."""
    fallback = tokenizer.convert_tokens_to_ids([f"<0x{byte:02X}>" for byte in range(256)])
    if tokenizer.unk_token_id not in fallback:
        return fallback
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, num_unprintable = [], 0
    for byte in range(256):
        chars.append(chr(byte) if byte in printable else chr(256 + num_unprintable))
        num_unprintable += byte not in printable
    return tokenizer.convert_tokens_to_ids(chars)


def sentencepiece_like():
    """A Llama-style tokenizer: "▁" for spaces, byte-fallback tokens for what the vocabulary
    lacks, the first space of a decoded text stripped (so a window's start matters)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    pieces = ["\u2581", *"abUs:\n", "\u2581a", "\u2581b", "\u2581U", "ab", "\u2581ab", "Us",
              "\u2581Us"]
    vocab.update({piece: 259 + i for i, piece in enumerate(pieces)})
    merges = [("\u2581", "a"), ("\u2581", "b"), ("\u2581", "U"), ("a", "b"), ("\u2581a", "b"),
              ("U", "s"), ("\u2581U", "s")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece_like"])
def any_tokenizer(request, tokenizer):
    return tokenizer if request.param == "byte_level" else sentencepiece_like()


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
@given(data=st.data(), include=st.booleans(), min_tokens=st.sampled_from([0, 0, 3, 20]),
       prompt=st.sampled_from([PROMPT, "ab Us"]))  # ending in byte tokens, or not
def test_the_text_and_every_delta_are_the_reference_ones(any_tokenizer, data, include,
                                                         min_tokens, prompt):
    tokenizer = any_tokenizer
    token_ids = data.draw(outputs(tokenizer))
    # The output decoded after the prompt (a tokenizer may strip a text's first space).
    prompt_ids = tokenizer.encode(prompt)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + token_ids, skip_special_tokens=True)[len(prompt_text):]
    stop = data.draw(st.lists(
        st.tuples(st.integers(0, len(full)), st.integers(1, 4)).map(
            lambda at: full[at[0]:at[0] + at[1]]).filter(bool), max_size=3))
    ours = run(IncrementalDetokenizer, tokenizer, token_ids, stop, include, min_tokens, prompt)
    assert ours == run(ReferenceDetokenizer, tokenizer, token_ids, stop, include, min_tokens,
                       prompt)
    deltas, text, _ = ours
    assert "".join(deltas) == text
    # Byte-fallback decoding turns a run of bytes that is not UTF-8 into one U+FFFD per byte,
    # judged on the whole run, where streaming emits a character once it is complete (the old
    # window too): bytes C2 80 80 stream as "\x80\ufffd", decode as three U+FFFD.
    is_byte_fallback = "<0x80>" in tokenizer.get_vocab()
    if not stop and not (is_byte_fallback and "\ufffd" in full):
        assert text == full


@pytest.mark.parametrize("output_bytes", [
    [0x80, 0x41, 0x41, 0x41, 0x41, 0xE2, 0x82, 0xAC, 0x41],
    [0x80] + [0x41] * 8 + [0xE2, 0x82, 0xAC],
])
def test_a_byte_fallback_run_made_invalid_early_stays_invalid(output_bytes):
    # The run's last bytes make characters, but its first does not: the decoder gives one U+FFFD
    # per byte, so a window that started inside the run would stream "A\u20ac".
    tokenizer = sentencepiece_like()
    byte_ids = byte_token_ids(tokenizer)
    token_ids = [byte_ids[byte] for byte in output_bytes]
    ours = run(IncrementalDetokenizer, tokenizer, token_ids, prompt="ab Us")
    assert ours == run(ReferenceDetokenizer, tokenizer, token_ids, prompt="ab Us")
    assert ours[1] == "\ufffd" * len(output_bytes)
