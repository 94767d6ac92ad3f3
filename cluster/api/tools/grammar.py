"""The grammar that enforces ``tool_choice`` ``required`` or a named function: an xgrammar
structural tag (`workers.structured.spec.StructuredOutput`, kind ``structural_tag``) over the
model's own tool-call format, built as JSON here (xgrammar is imported by the engine only).

- ``required``: one or more calls of the request's functions and nothing else (exactly one when
  ``parallel_tool_calls`` is false), each function's arguments valid for its ``parameters``;
- named: exactly one call of that function.

The text each format's grammar allows is what `cluster.api.tools.call_stream` parses: a call
object names its function first, then its arguments.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from cluster.api.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from workers.structured.spec import GrammarKind, StructuredOutput

# Consecutive whitespace characters allowed between the JSON tokens of arguments: a model cannot
# spend its whole budget on whitespace inside a call.
MAX_WHITESPACE = 8
ANY_OBJECT: Dict[str, Any] = {"type": "object"}


def _call_tag(fmt: ToolFormat, name: str, parameters: Optional[Dict[str, Any]]
              ) -> Dict[str, Any]:
    key = fmt.args_keys[0]
    begin = '{"name": ' + json.dumps(name) + ', "' + key + '": '
    end = "}"
    if fmt is HERMES:
        begin, end = "<tool_call>\n" + begin, end + "\n</tool_call>"
    return {"type": "tag", "begin": begin, "end": end,
            "content": {"type": "json_schema", "json_schema": parameters or ANY_OBJECT,
                        "style": "json", "max_whitespace_cnt": MAX_WHITESPACE}}


def _separator(fmt: ToolFormat) -> str:
    return {HERMES.name: "\n", LLAMA3_JSON.name: "; ", MISTRAL.name: ", "}[fmt.name]


def _framed(fmt: ToolFormat, calls: Dict[str, Any], marker_is_token: bool) -> Dict[str, Any]:
    """Mistral's calls inside ``[TOOL_CALLS][...]``; the other formats' as they are."""
    if fmt is not MISTRAL:
        return calls
    marker = fmt.opens[0]
    opening = ({"type": "token", "token": marker} if marker_is_token
               else {"type": "const_string", "value": marker})
    return {"type": "sequence", "elements": [
        opening, {"type": "const_string", "value": fmt.first}, calls,
        {"type": "const_string", "value": fmt.close}]}


def tool_grammar(fmt: ToolFormat, functions: Sequence[Any], named: Optional[str],
                 parallel: bool, marker_is_token: bool = False) -> StructuredOutput:
    """The constraint for ``required`` (``named`` None) or for the function ``named``, over
    ``functions`` (the request's ``FunctionDefinition``s). ``marker_is_token``: the format's
    marker is one token of the tokenizer (Mistral's ``[TOOL_CALLS]``), matched as that token.
    ValueError when the spec is too long (`StructuredOutput`'s check)."""
    chosen = [f for f in functions if named is None or f.name == named]
    tags: List[Dict[str, Any]] = [_call_tag(fmt, f.name, f.parameters) for f in chosen]
    if named is not None:
        calls: Dict[str, Any] = tags[0]
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": _separator(fmt),
                 "at_least_one": True, "stop_after_first": not parallel}
    spec = {"type": "structural_tag", "format": _framed(fmt, calls, marker_is_token)}
    return StructuredOutput(GrammarKind.STRUCTURAL_TAG, json.dumps(spec))
