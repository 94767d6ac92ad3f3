"""Where a JSON object or array ends, found character by character as the text arrives.

`JsonSpan` tracks nesting and strings only: it finds the end of a value that is well formed, and
says nothing about whether it is; `json.loads` of the finished span decides that. Cost: O(1) per
character fed, whatever the split of the text into pieces.
"""

from __future__ import annotations

from typing import Optional

_OPEN = "{["
_CLOSE = "}]"


class JsonSpan:
    """One JSON object or array, fed from its first character on. ``end`` is the length of the
    value once its closing bracket was fed (None before); ``is_broken`` is set when the text
    cannot be the value (it does not start with a bracket, or a bracket does not match)."""

    def __init__(self) -> None:
        self._stack: list = []
        self._in_string = False
        self._escape = False
        self.length = 0  # characters fed
        self.end: Optional[int] = None
        self.is_broken = False

    @property
    def depth(self) -> int:
        return len(self._stack)

    def feed(self, text: str) -> Optional[int]:
        """Feed more text; the value's end (an offset from its start) once known. Characters
        fed past the end are not consumed (``length`` stops at the end)."""
        for ch in text:
            if self.end is not None or self.is_broken:
                break
            self.length += 1
            self._step(ch)
        return self.end

    def _step(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return
        if not self._stack and self.length == 1 and ch not in _OPEN:
            self.is_broken = True
        elif ch == '"':
            self._in_string = True
        elif ch in _OPEN:
            self._stack.append(_CLOSE[_OPEN.index(ch)])
        elif ch in _CLOSE:
            if ch != self._stack.pop():
                self.is_broken = True
            elif not self._stack:
                self.end = self.length
