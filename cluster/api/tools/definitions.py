"""A chat request's tool fields, as OpenAI's SDK sends them: ``tools`` (function definitions),
``tool_choice`` (``none``, ``auto``, ``required`` or ``{"type": "function", "function":
{"name": ...}}``), ``parallel_tool_calls``; and the assistant messages' ``tool_calls``.

Limits: at most ``MAX_TOOLS`` functions, whose definitions take at most
`workers.structured.spec.MAX_SPEC_CHARS` characters of JSON in all (they become the grammar of a
``required`` or named choice, and part of the prompt). Every violation is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.api.protocol import ProtocolError
from workers.structured.spec import MAX_SPEC_CHARS

MAX_TOOLS = 128
# OpenAI's rule for function names; it also keeps them plain inside the grammar's JSON.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -; at most 64.")
    description: Optional[str] = Field(None, description="What the function does.")
    parameters: Optional[Dict[str, Any]] = Field(
        None, description="Its arguments as a JSON schema (an object); none: no arguments.")
    strict: Optional[bool] = Field(None, description="Arguments always follow the schema.")


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = Field(description="Only 'function'.")
    function: FunctionDefinition

    def template_tool(self) -> Dict[str, Any]:
        """The tool as chat templates read it (``tools`` of ``apply_chat_template``)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(BaseModel):
    name: str = Field(description="The function to call.")


class NamedToolChoice(BaseModel):
    type: Literal["function"] = Field(description="Only 'function'.")
    function: FunctionName


class FunctionCall(BaseModel):
    name: str = Field(description="The function called.")
    arguments: str = Field(description="Its arguments: a JSON object, as text.")


class AssistantToolCall(BaseModel):
    """One call in an assistant message of the history."""

    id: str = Field(description="The call's id; a tool message's tool_call_id names it.")
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self, param: str) -> Dict[str, Any]:
        """The call as chat templates read it: the arguments as a mapping. ``param`` names the
        call in the 400 when they are not a JSON object."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError as exc:
            arguments = exc
        if not isinstance(arguments, dict):
            got = (f"invalid JSON ({arguments})" if isinstance(arguments, Exception)
                   else type(arguments).__name__)
            raise ProtocolError(f"{param}.function.arguments: expected a JSON object as text, "
                                f"got {got}", param=f"{param}.function.arguments")
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolFields(BaseModel):
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request."""

    tools: Optional[List[ToolDefinition]] = Field(
        None, description=f"Functions the model may call (at most {MAX_TOOLS}).")
    tool_choice: Optional[ToolChoice] = Field(
        None, description="none, auto (default with tools), required, or a named function.")
    parallel_tool_calls: Optional[bool] = Field(
        None, description="Several calls in one answer (default true).")

    @model_validator(mode="after")
    def _checked_tools(self) -> "ToolFields":
        tools = self.tools or []
        if len(tools) > MAX_TOOLS:
            raise ProtocolError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}",
                                param="tools")
        names = [t.function.name for t in tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ProtocolError(f"tools: function names must be unique; {twice} repeat",
                                param="tools")
        size = sum(len(json.dumps(t.template_tool())) for t in tools)
        if size > MAX_SPEC_CHARS:
            raise ProtocolError(f"tools: the definitions take {size} characters of JSON; at "
                                f"most {MAX_SPEC_CHARS} are accepted", param="tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not tools:
            raise ProtocolError("tool_choice: a tool must be called, but the request has no "
                                "tools; send tools or drop tool_choice", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ProtocolError(f"tool_choice: the function {choice.function.name!r} is not "
                                f"among the request's tools {names}", param="tool_choice")
        return self

    @property
    def effective_tool_choice(self) -> Union[str, NamedToolChoice]:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def named_function(self) -> Optional[str]:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def template_tools(self) -> Optional[List[Dict[str, Any]]]:
        """``tools`` for the chat template, None without tools."""
        return [t.template_tool() for t in self.tools] if self.tools else None
