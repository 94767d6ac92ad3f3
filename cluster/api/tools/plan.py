"""What a chat request's tools ask of its run: a grammar for the engine (``required`` or a
named function) and, unless ``tool_choice`` is none, a parser per choice.

``tool_choice`` none: the tools are rendered in the prompt and the output is plain content, as
vLLM does. ``auto``: the output is parsed (streamed: as it arrives). ``required`` and named: the
engine's grammar forces calls in the model's format, and the output is parsed the same way.
A choice that ends (``stop``) with tool calls finishes with ``tool_calls``, as OpenAI's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from cluster.api.protocol import ProtocolError
from cluster.api.tools.call_stream import CallStream, parse
from cluster.api.tools.calls import ParsedDelta, ParsedOutput
from cluster.api.tools.formats import ToolFormat, require_format
from cluster.api.tools.grammar import tool_grammar
from workers.structured.spec import StructuredOutput


@dataclass(frozen=True)
class ToolPlan:
    """One request's tool calling. ``marker_token_id``: the format's marker when the tokenizer
    keeps it as a special token, which the engine's detokenizer drops: each choice puts the
    marker back before the text of the chunk that generated it (a decode step's chunk holds one
    token)."""

    format: ToolFormat
    structured: Optional[StructuredOutput]
    marker_token_id: Optional[int] = None

    def choice(self) -> "ChoiceTools":
        return ChoiceTools(self)


class ChoiceTools:
    """The tool calls of one choice: its text as the parser reads it, and the streamed
    parser."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self._num_streamed = 0  # characters of ``text`` fed to the stream
        self._stream = CallStream(plan.format)

    def add(self, text: str, token_ids: Sequence[int]) -> None:
        """A chunk's text as the parser reads it (the marker put back), added to ``text``."""
        marker_id = self.plan.marker_token_id
        if marker_id is not None and marker_id in token_ids:
            text = self.plan.format.opens[0] + text
        self.text += text

    def _stream_new(self) -> ParsedDelta:
        """What the text added since the last call adds to the stream of deltas."""
        parsed = self._stream.feed(self.text[self._num_streamed:])
        self._num_streamed = len(self.text)
        return parsed

    def streamed(self, finished: bool, reason: Optional[str]
                 ) -> Tuple[ParsedDelta, Optional[str]]:
        """What a chunk adds to the stream (its end's deltas too when ``finished``), and the
        finish reason to show."""
        parsed = self._stream_new()
        if finished:
            parsed.extend(self._stream.finish())
            reason = finish_reason(reason, self._stream.num_calls > 0)
        return parsed, reason

    def result(self) -> ParsedOutput:
        """The whole choice parsed (the non-streamed response)."""
        return parse(self.plan.format, self.text)

    def response(self, reason: Optional[str]) -> Tuple[ParsedOutput, Optional[str]]:
        """The whole choice parsed, and the finish reason to show."""
        parsed = self.result()
        return parsed, finish_reason(reason, bool(parsed.calls))


def finish_reason(reason: Optional[str], has_calls: bool) -> Optional[str]:
    """OpenAI's ``tool_calls`` for a choice that stopped after calling tools."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def _marker_token_id(fmt: ToolFormat, tokenizer: Any) -> Optional[int]:
    """The id of the format's marker when the tokenizer has it as a special token (dropped from
    decoded text), else None."""
    if tokenizer is None:
        return None
    marker = fmt.opens[0]
    if marker not in getattr(tokenizer, "all_special_tokens", ()):
        added = getattr(tokenizer, "added_tokens_decoder", {})
        if not any(t.content == marker and t.special for t in added.values()):
            return None
    token_id = tokenizer.convert_tokens_to_ids(marker)
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None


def plan_tools(body: Any, fmt: Optional[ToolFormat], tokenizer: Any) -> Optional[ToolPlan]:
    """The tool plan of a chat request (`cluster.api.tools.definitions.ToolFields`) on a server
    whose tool-call format is ``fmt`` (None: it has none). None without tools, or with
    ``tool_choice`` none. A 400 naming ``tools`` when the server has no format."""
    if not body.tools:
        return None
    fmt = require_format(fmt)
    choice = body.effective_tool_choice
    if choice == "none":
        return None
    marker_id = _marker_token_id(fmt, tokenizer)
    structured = None
    if choice != "auto":
        functions = [t.function for t in body.tools]
        try:
            structured = tool_grammar(fmt, functions, body.named_function,
                                      body.parallel_tool_calls is not False,
                                      marker_is_token=marker_id is not None)
        except ValueError as exc:
            raise ProtocolError(f"tools: {exc}", param="tools") from None
    return ToolPlan(fmt, structured, marker_id)
