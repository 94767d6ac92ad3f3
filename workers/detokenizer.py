"""Incremental detokenization with stop strings.

Decoding only the newest tokens can split a multi-byte character or a word-piece boundary, so
each step decodes a short window that starts a few tokens back (``prefix_offset``) and takes the
text past what that window decoded to before, waiting while the text ends in an incomplete
character.

A stop string can arrive over several tokens (``" User"`` then ``":"``), so text that could be the
start of one is held back until the next tokens show whether it is: the held text is the longest
suffix of the decoded text that is a prefix of some stop string. Invariants, after every call:

- ``text`` is the concatenation of every delta returned so far;
- ``text`` never contains a stop string (with ``include_stop_str_in_output``: only at its end);
- once the request ends, ``text`` is the decoded output cut at the stop string that completed
  first, before it (or right after it, with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

_PREFIX_TOKENS = 6  # prompt tokens decoded with the first output token, for word-piece context


class IncrementalDetokenizer:
    """One request's output text. Per token it costs two decodes of a window of a few tokens and
    O(stops x longest stop^2) character comparisons; memory is the text itself."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_token_ids[-_PREFIX_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
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
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith("\ufffd")):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

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
