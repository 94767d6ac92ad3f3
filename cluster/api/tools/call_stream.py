"""A choice's text to content and tool calls, streamed (`CallStream`) or whole (`parse`).

`CallStream` reads the text in the pieces it arrives in and says, for each piece, what it adds:
content, a call's id and name (once its object's ``{"name": "...", "arguments":`` is read),
then fragments of the call's arguments as they arrive. What it returns never depends on how the
text was split. Text that may still turn into a run of calls (a marker's first characters, a
Llama ``{``) is held back until it is known; whitespace next to calls is not content.

`parse` runs the same reader over the whole text, so a call parsed whole has the arguments that
the streamed fragments add up to. It also sees the end: a run whose call turns out malformed (its
JSON broken, or cut off) is read again as content. Streamed, what was already sent of such a call
stays sent, and the text after the break follows as content.

Cost: O(1) per character, plus a match of the short call header while one is being read.
"""

from __future__ import annotations

import json
from typing import AbstractSet, Any, List, Optional, Tuple

import regex

from cluster.api.tools.calls import ParsedDelta, ParsedOutput, ToolCallDelta, assemble, new_call_id
from cluster.api.tools.formats import ToolFormat
from cluster.api.tools.json_span import JsonSpan

_TEXT, _OPEN, _OBJECT, _AFTER = range(4)
_WS = regex.compile(r"\s*")


def _header(fmt: ToolFormat) -> Any:
    keys = "|".join(regex.escape(k) for k in fmt.args_keys)
    return regex.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys +
                         r')"\s*:\s*\{')


class CallStream:
    """The reader of one choice's text in ``fmt``. ``rejected``: positions of run openings
    (or call objects) to read as content (`parse` uses them)."""

    def __init__(self, fmt: ToolFormat, rejected: AbstractSet[int] = frozenset()) -> None:
        self.fmt = fmt
        self._rejected = rejected
        self._header = _header(fmt)
        self._opening = regex.compile(r"\s*" + regex.escape(fmt.first) + r"\s*\{")
        self._text = ""
        self._pos = 0  # everything before it is decided
        self._phase = _TEXT
        self._run_start = 0  # where the current run opened
        self._sep_pos: Optional[int] = None  # before the current object, if not the run's first
        self._obj_start = 0
        self._obj: Optional[JsonSpan] = None  # None: the call is not announced yet
        self._args: JsonSpan = JsonSpan()
        self._args_start = self._args_sent = 0
        self._name = ""
        self._held_ws = ""  # trailing whitespace of the content, sent only if text follows
        self.num_calls = 0
        self.broken_at: Optional[int] = None  # the first malformed run's (or object's) start

    def feed(self, text: str) -> ParsedDelta:
        """What ``text``, the next piece of the choice's text, adds."""
        self._text += text
        out = ParsedDelta()
        while self._advance(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """What the end of the text decides (held text released as content)."""
        out = ParsedDelta()
        while self._advance(out, final=True):
            pass
        if self._phase == _TEXT:
            self._content(out, self._text[self._pos:])
        elif self._phase in (_OPEN, _OBJECT) and self._obj is None:
            self._content(out, self._text[self._undo_point():])
        elif self._phase == _OBJECT:  # cut off inside a call
            self._break()
        if not self.num_calls:
            out.content += self._held_ws
        self._held_ws, self._pos = "", len(self._text)
        return out

    # ----- phases: each returns True when it moved on, False when it needs more text

    def _advance(self, out: ParsedDelta, final: bool) -> bool:
        if self._phase == _TEXT:
            return self._in_text(out, final)
        if self._phase == _OPEN:
            return self._in_opening(out, final)
        if self._phase == _OBJECT:
            return self._in_object(out)
        return self._after_object(out, final)

    def _in_text(self, out: ParsedDelta, final: bool) -> bool:
        found = self._next_opening()
        if found is None:
            safe = len(self._text) if final else len(self._text) - self._held_tail()
            self._content(out, self._text[self._pos:safe])
            self._pos = max(self._pos, safe)
            return False
        start, marker = found
        self._content(out, self._text[self._pos:start])
        self._run_start, self._sep_pos = start, None
        self._pos = start + len(marker)
        self._phase = _OPEN
        return True

    def _in_opening(self, out: ParsedDelta, final: bool) -> bool:
        m = self._opening.match(self._text, self._pos, partial=True)
        if m is not None and not m.partial:
            self._start_object(m.end() - 1)
            return True
        if m is None or final:
            self._undo_run()
            return True
        return False

    def _in_object(self, out: ParsedDelta) -> bool:
        if self._obj is None:
            m = self._header.match(self._text, self._obj_start, partial=True)
            if m is not None and m.partial:
                return False
            name = _json_string(m.group(1)) if m is not None else None
            if name is None:
                self._undo_run()
                return True
            self._announce(out, name, m.end() - 1)
        text = self._text
        self._obj.feed(text[self._obj_start + self._obj.length:])
        args_end = self._args.feed(text[self._args_start + self._args.length:])
        sent_to = len(text) if args_end is None else self._args_start + args_end
        if sent_to > self._args_sent:
            out.add_call(ToolCallDelta(self.num_calls - 1, text[self._args_sent:sent_to]))
            self._args_sent = sent_to
        if self._obj.is_broken or self._args.is_broken:
            self._break()
            return True
        if self._obj.end is None:
            return False
        if not self._is_valid_call(text[self._obj_start:self._obj_start + self._obj.end]):
            self._break()
            return True
        self._pos, self._phase = self._obj_start + self._obj.end, _AFTER
        return True

    def _after_object(self, out: ParsedDelta, final: bool) -> bool:
        text, fmt = self._text, self.fmt
        ws_end = _WS.match(text, self._pos).end()
        rest = text[ws_end:]
        if fmt.separator and rest.startswith(fmt.separator):
            after = _WS.match(text, ws_end + len(fmt.separator)).end()
            if after == len(text) and not final:
                return False
            if after < len(text) and text[after] == "{" and after not in self._rejected:
                self._sep_pos = self._pos
                self._start_object(after)
                return True
        elif fmt.close and rest.startswith(fmt.close):
            self._end_run(ws_end + len(fmt.close))
            return True
        elif not final and any(m and m.startswith(rest) for m in (fmt.separator, fmt.close)):
            return False  # all whitespace, or a separator's or the closing's first characters
        self._end_run(self._pos)  # the run ends here; what follows is content
        return True

    # ----- steps

    def _next_opening(self) -> Optional[Tuple[int, str]]:
        """The first run opening at or after ``_pos`` that is not rejected."""
        best: Optional[Tuple[int, str]] = None
        markers = [*self.fmt.opens, *(["{"] if self.fmt.bare_object else [])]
        for marker in markers:
            at = self._text.find(marker, self._pos)
            while at >= 0 and at in self._rejected:
                at = self._text.find(marker, at + 1)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, "" if marker == "{" else marker)
        return best

    def _held_tail(self) -> int:
        """How many characters at the end may be the start of a marker."""
        text = self._text
        for size in range(min(len(text) - self._pos, max(map(len, self.fmt.opens)) - 1), 0, -1):
            if any(m.startswith(text[-size:]) for m in self.fmt.opens):
                return size
        return 0

    def _start_object(self, at: int) -> None:
        self._phase, self._obj_start, self._obj = _OBJECT, at, None

    def _announce(self, out: ParsedDelta, name: str, args_start: int) -> None:
        self._held_ws = ""
        self._obj, self._args = JsonSpan(), JsonSpan()
        self._name, self._args_start, self._args_sent = name, args_start, args_start
        out.add_call(ToolCallDelta(self.num_calls, "", new_call_id(), name))
        self.num_calls += 1

    def _is_valid_call(self, obj_text: str) -> bool:
        try:
            value = json.loads(obj_text)
        except ValueError:
            return False
        args = next((value[k] for k in self.fmt.args_keys if k in value), None)
        return value.get("name") == self._name and isinstance(args, dict)

    def _undo_point(self) -> int:
        """Where the text of an unannounced object starts being content again."""
        return self._run_start if self._sep_pos is None else self._sep_pos

    def _undo_run(self) -> None:
        """The opening (or the separator) turned out not to start a call: it is content."""
        point = self._undo_point()
        self._rejected = self._rejected | {self._run_start if self._sep_pos is None
                                           else self._obj_start}
        self._pos, self._phase = point, _TEXT

    def _break(self) -> None:
        """An announced call is malformed: the rest of the text is content."""
        if self.broken_at is None:
            self.broken_at = self._run_start if self._sep_pos is None else self._obj_start
        self._pos, self._phase = self._args_sent, _TEXT

    def _end_run(self, at: int) -> None:
        self._pos, self._phase = at, _TEXT

    def _content(self, out: ParsedDelta, text: str) -> None:
        text = self._held_ws + text
        body = text.rstrip()
        out.content += body
        self._held_ws = text[len(body):]


def _json_string(raw: str) -> Optional[str]:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return None


def parse(fmt: ToolFormat, text: str) -> ParsedOutput:
    """A whole choice's content (None when there is only whitespace beside its calls) and its
    calls; a malformed run is content."""
    rejected: set = set()
    while True:
        stream = CallStream(fmt, frozenset(rejected))
        parsed = stream.feed(text)
        parsed.extend(stream.finish())
        if stream.broken_at is None:
            break
        rejected.add(stream.broken_at)
    calls = assemble(parsed.calls)
    return ParsedOutput(parsed.content if parsed.content or not calls else None, calls)


def stream_parse(fmt: ToolFormat, pieces: List[str]) -> ParsedOutput:
    """What a client assembles from the deltas of ``pieces`` streamed (tests, the gRPC API)."""
    stream = CallStream(fmt)
    merged = ParsedDelta()
    for piece in pieces:
        merged.extend(stream.feed(piece))
    merged.extend(stream.finish())
    calls = assemble(merged.calls)
    return ParsedOutput(merged.content if merged.content or not calls else None, calls)
