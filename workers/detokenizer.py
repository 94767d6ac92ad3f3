"""Incremental detokenization with stop strings.

Decoding only the newest tokens can split a multi-byte character or a word-piece boundary, so
each step decodes a short window that starts a few tokens back (``prefix_offset``) and emits the
text past what that window decoded to before, holding back text that ends in an incomplete
character. Stop strings are searched in the new text plus the few characters before it.
"""

from __future__ import annotations

from typing import Optional, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append a token; returns the new text (possibly empty)."""
        self._ids.append(token_id)
        return self._emit(hold_incomplete=True)

    def flush(self) -> str:
        """At the end of a request: emit what was held back, incomplete characters included."""
        return self._emit(hold_incomplete=False)

    def _emit(self, hold_incomplete: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith("\ufffd")):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def find_stop(self, delta: str) -> Optional[int]:
        """If a stop string now appears, truncate ``text`` before it and return the cut index."""
        if not self.stop or not delta:
            return None
        start = max(0, len(self.text) - len(delta) - self._max_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        self.text = self.text[:cut]
        return cut
