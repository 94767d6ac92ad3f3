"""Tool calls as a parser produces them and as OpenAI's chat API shows them.

A call's ``arguments`` is the JSON text of the arguments object exactly as the model wrote it
(validated as a JSON object): streamed, its fragments concatenate to the same text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


def new_call_id() -> str:
    """``call_`` and 24 random hexadecimal digits, unique per call."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call of a function."""

    id: str
    name: str
    arguments: str  # a JSON object's text

    def openai(self) -> Dict[str, Any]:
        """``message.tool_calls[i]``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of call ``index`` (its place in the choice's calls): the first part of a call has
    its ``id`` and ``name``; the next ones add to its arguments."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None

    def openai(self) -> Dict[str, Any]:
        """``delta.tool_calls[i]``."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """What one piece of a choice's text adds: content text, and parts of calls in order."""

    content: str = ""
    calls: List[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def add_call(self, delta: ToolCallDelta) -> None:
        """``delta``, merged into the last part when it continues the same call (one part per
        call and piece)."""
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index and delta.name is None:
            self.calls[-1] = ToolCallDelta(last.index, last.arguments + delta.arguments,
                                           last.id, last.name)
        else:
            self.calls.append(delta)

    def extend(self, other: "ParsedDelta") -> None:
        self.content += other.content
        for delta in other.calls:
            self.add_call(delta)


@dataclass
class ParsedOutput:
    """A choice's whole text: its content (None when it is only tool calls) and its calls."""

    content: Optional[str]
    calls: List[ToolCall]


def assemble(deltas: List[ToolCallDelta]) -> List[ToolCall]:
    """The calls that ``deltas`` (in order) describe."""
    parts: Dict[int, List[Any]] = {}
    for d in deltas:
        if d.name is not None:
            parts[d.index] = [d.id, d.name, d.arguments]
        else:
            parts[d.index][2] += d.arguments
    return [ToolCall(*parts[i]) for i in sorted(parts)]
