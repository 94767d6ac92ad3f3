"""The tool-call formats of the model families tpserve loads, and which one a chat template uses.

Each format is a `ToolFormat`: how a run of calls opens in the model's text, what separates its
calls and what closes it. A call is a JSON object that names its function first:
``{"name": "f", "arguments": {...}}`` (Llama 3 writes ``"parameters"``).

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": ...}\\n
  </tool_call>``, one call per tag, as many tags as calls, text around them.
- ``llama3_json`` (Llama 3.1-3.3 JSON tools): ``<|python_tag|>`` or nothing, then calls
  separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of calls.

A marker that the tokenizer keeps as a special token (``<|python_tag|>``, ``[TOOL_CALLS]``) is
dropped from the text the engine detokenizes; `cluster.api.tools.plan` puts it back where its
token was generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from cluster.api.protocol import ProtocolError

AUTO = "auto"


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax. A run opens with one of ``opens`` (or, with ``bare_object``, with a
    call object itself), then ``first`` (text before the first call), calls separated by
    ``separator`` (None: one call per run), then ``close`` ("" : the run ends at anything that
    is not a separator). ``args_keys``: how the arguments member may be named."""

    name: str
    opens: Tuple[str, ...]
    first: str = ""
    separator: Optional[str] = None
    close: str = ""
    bare_object: bool = False
    args_keys: Tuple[str, ...] = ("arguments",)


HERMES = ToolFormat("hermes", opens=("<tool_call>",), close="</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", opens=("<|python_tag|>",), separator=";",
                         bare_object=True, args_keys=("parameters", "arguments"))
MISTRAL = ToolFormat("mistral", opens=("[TOOL_CALLS]",), first="[", separator=",", close="]")
FORMATS = {f.name: f for f in (LLAMA3_JSON, HERMES, MISTRAL)}
PARSER_CHOICES = (*FORMATS, AUTO)
# What in a chat template says which format its model writes, checked in this order.
_TEMPLATE_SIGNS = (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL),
                   ("<|python_tag|>", LLAMA3_JSON), ("ipython", LLAMA3_JSON))


def detect_format(chat_template: Any) -> Optional[ToolFormat]:
    """The format a chat template's tool section uses (a named-template dict: any of them), or
    None when it shows none."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not isinstance(chat_template, str):
        return None
    for sign, fmt in _TEMPLATE_SIGNS:
        if sign in chat_template:
            return fmt
    return None


def server_format(option: str, chat_template: Any) -> Optional[ToolFormat]:
    """The format of ``--tool-call-parser``: the one named, or for ``auto`` the chat
    template's (None: no tool calling on this server)."""
    if option == AUTO:
        return detect_format(chat_template)
    if option not in FORMATS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_CHOICES)}, got "
                         f"{option!r}")
    return FORMATS[option]


def require_format(fmt: Optional[ToolFormat]) -> ToolFormat:
    """``fmt``, or the 400 for a request with tools on a server without a tool-call format."""
    if fmt is None:
        raise ProtocolError("tools: this model's chat template shows no tool-call format this "
                            "server can parse; start the server with --tool-call-parser "
                            "{llama3_json,hermes,mistral} to name it", param="tools")
    return fmt
