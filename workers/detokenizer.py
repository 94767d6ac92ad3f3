"""Incremental detokenization with stop strings.

Decoding only the newest tokens can split a multi-byte character or a word-piece boundary, so
each step decodes a short window that starts a few tokens back (``prefix_offset``) and takes the
text past what that window decoded to before, waiting while the text ends in an incomplete
character. The window stays a few tokens long whatever the output:

- special tokens, which decoding skips, never enter it (decoding drops them before it decodes);
- while the text keeps ending in an incomplete character (a run of bytes that make none), the
  tokens before the last ``_TAIL`` are decided: their text is kept, waiting to be emitted, and
  the window starts ``_TAIL`` tokens before them. A character, or an invalid byte sequence that
  decodes to one U+FFFD, spans at most 4 bytes, so ``_TAIL`` tokens of context on each side of
  that boundary decode it as the whole window did; the move is checked against the whole
  window's text and waits a token where they differ. A byte-fallback decoder (Llama, Mistral)
  judges a whole run of byte tokens at once, so the window moves on only between runs: a long
  run of byte tokens still grows it there.

The text is, to the character, what the unbounded window gave (``ReferenceDetokenizer`` in
``scripts/bench_detokenizer.py``; ``tests/workers/test_detokenizer_window.py`` compares them).

A stop string can arrive over several tokens (``" User"`` then ``":"``), so text that could be the
start of one is held back until the next tokens show whether it is: the held text is the longest
suffix of the decoded text that is a prefix of some stop string. Invariants, after every call:

- ``text`` is the concatenation of every delta returned so far;
- ``text`` never contains a stop string (with ``include_stop_str_in_output``: only at its end);
- once the request ends, ``text`` is the decoded output cut at the stop string that completed
  first, before it (or right after it, with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import FrozenSet, List, Optional, Sequence, Tuple

_PREFIX_TOKENS = 6  # prompt tokens decoded with the first output token, for word-piece context
_TAIL = 3  # tokens kept undecided after a boundary inside a run of incomplete characters
_MAX_PENDING = 2 * _TAIL  # undecided tokens that make the window move on past the older ones


@lru_cache(maxsize=16)
def skipped_special_ids(tokenizer) -> FrozenSet[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops before decoding: the added
    tokens marked special for a fast tokenizer, ``all_special_ids`` otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return frozenset(i for i, token in backend.get_added_tokens_decoder().items()
                         if token.special)
    return frozenset(tokenizer.all_special_ids)


@lru_cache(maxsize=16)
def byte_fallback_ids(tokenizer) -> FrozenSet[int]:
    """The byte tokens (``<0x80>``) of a tokenizer whose decoder falls back to bytes; empty for
    others. Such a decoder judges a whole run of byte tokens at once (invalid UTF-8 anywhere in
    it: one U+FFFD per byte), so no window may start inside a run."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteFallback" not in repr(backend.decoder):
        return frozenset()
    vocab = backend.get_vocab()
    return frozenset(vocab[name] for name in (f"<0x{byte:02X}>" for byte in range(256))
                     if name in vocab)


class IncrementalDetokenizer:
    """One request's output text. Per token it costs two decodes of a window of at most about
    16 tokens (longer only inside a run of byte-fallback tokens), three more decodes of as many
    while a run of incomplete characters moves the window on, and O(stops x longest stop^2)
    character comparisons; memory is the text itself."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._skipped_ids = skipped_special_ids(tokenizer)
        self._byte_ids = byte_fallback_ids(tokenizer)
        self._ids = list(prompt_token_ids[-_PREFIX_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Text of the ids before the read offset not yet emitted (it ends in U+FFFD), in pieces:
        # joining them once, when it is emitted, keeps a long run of them linear.
        self._pending: List[str] = []
        self.text = ""  # what was emitted
        self._held = ""  # decoded, not emitted: it may be the start of a stop string
        self.is_stopped = False

    @property
    def num_window_ids(self) -> int:
        """How many token ids the next step decodes (twice): the window's length."""
        return len(self._ids) - self._prefix_offset + 1

    def add_token(self, token_id: int, can_stop: bool = True) -> Tuple[str, bool]:
        """Append a token; returns the text to emit now (possibly empty) and whether a stop
        string matched (the request ends there: nothing more is emitted, flush included).
        With ``can_stop`` false (``min_tokens`` not yet passed) stop strings are ordinary text."""
        if self.is_stopped:
            return "", True
        if token_id in self._skipped_ids:
            new_text = ""  # the decoded text is unchanged, so the step's outcome is too
        else:
            self._ids.append(token_id)
            new_text = self._decode_new(hold_incomplete=True)
        if not can_stop:
            delta, self._held = self._held + new_text, ""
            self.text += delta
            return delta, False
        return self._release(new_text, is_final=False)

    def flush(self) -> str:
        """At the end of a request: the text held back (for an incomplete character or a stop
        string that never came); empty after a stop string matched."""
        if self.is_stopped:
            return ""
        delta, _ = self._release(self._decode_new(hold_incomplete=False), is_final=True)
        return delta

    def _decode_new(self, hold_incomplete: bool) -> str:
        """The text the tokens since the last call decode to ("" while it ends in an incomplete
        character and ``hold_incomplete``)."""
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        tail = full[len(prefix):]
        end = tail or (self._pending[-1] if self._pending else "")
        if not end or (hold_incomplete and end.endswith("\ufffd")):
            if len(self._ids) - self._read_offset > _MAX_PENDING:
                self._move_on(prefix, full)
            return ""
        new_text = "".join(self._pending) + tail
        self._pending.clear()
        self._advance(self._read_offset, len(self._ids))
        return new_text

    def _move_on(self, prefix: str, full: str) -> None:
        """Decide the undecided tokens but the last ``_TAIL``: keep their text as pending and
        start the window ``_TAIL`` tokens before them, when that window decodes the tail to what
        the whole one does (it may not, next to a word-piece boundary: then wait a token)."""
        decode = self.tokenizer.decode
        cut = len(self._ids) - _TAIL
        start = cut - _TAIL
        if self._ids[cut - 1] in self._byte_ids and self._ids[cut] in self._byte_ids:
            return
        upto_cut = decode(self._ids[self._prefix_offset:cut], skip_special_tokens=True)
        context = decode(self._ids[start:cut], skip_special_tokens=True)
        window = decode(self._ids[start:], skip_special_tokens=True)
        # An empty context (tokens that decode to nothing) would not carry word-piece context.
        if (not context or not upto_cut.startswith(prefix) or not full.startswith(upto_cut)
                or window[len(context):] != full[len(upto_cut):]):
            return
        if len(upto_cut) > len(prefix):
            self._pending.append(upto_cut[len(prefix):])
        self._advance(start, cut)

    def _advance(self, prefix_offset: int, read_offset: int) -> None:
        del self._ids[:prefix_offset]  # the window starts at the prefix offset from now on
        self._prefix_offset = 0
        self._read_offset = read_offset - prefix_offset

    def _release(self, new_text: str, is_final: bool) -> Tuple[str, bool]:
        # A stop string can only start inside the held text: anything earlier was emitted
        # because no stop string could start there.
        pending = self._held + new_text
        cut = self._find_stop(pending)
        if cut is not None:
            delta, self._held, self.is_stopped = pending[:cut], "", True
        else:
            num_held = 0 if is_final else self._stop_prefix_len(pending)
            delta, self._held = pending[:len(pending) - num_held], pending[len(pending) - num_held:]
        self.text += delta
        return delta, self.is_stopped

    def _find_stop(self, pending: str) -> Optional[int]:
        """Where ``pending`` ends if a stop string occurs in it: at the one that completes first
        (the longest of those ending there), before it or after it."""
        hits = [(i + len(s), i) for s in self.stop for i in (pending.find(s),) if i >= 0]
        if not hits:
            return None
        end, start = min(hits)
        return end if self.include_stop_str_in_output else start

    def _stop_prefix_len(self, pending: str) -> int:
        """The length of the longest suffix of ``pending`` that is a prefix of a stop string."""
        for length in range(min(len(pending), self._max_stop - 1), 0, -1):
            suffix = pending[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0
