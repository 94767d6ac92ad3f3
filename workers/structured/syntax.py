"""Whether a `StructuredOutput` is well formed, known without a tokenizer: its xgrammar grammar
is built (JSON schema, regular expression, EBNF grammar, structural tag) but not compiled.

The API calls ``check_syntax`` for each constrained request before routing it, so a schema,
regex or grammar that cannot compile is a 400 at the ingress, not an error from a TP group.
Building a grammar costs microseconds to milliseconds for a spec within the limits that
`StructuredOutput` checks (``MAX_SPEC_CHARS``, ``MAX_JSON_DEPTH``). xgrammar is imported on the
first call (seconds), never at import of this module: call ``load`` off the event loop first.
"""

from __future__ import annotations

import re
from typing import Any

from workers.structured.spec import GrammarKind, StructuredOutput

# xgrammar's C++ errors start "[HH:MM:SS] /path/file.cc:LINE: ": not the client's business.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)


def load() -> Any:
    """The xgrammar module (imported once; the first call takes seconds)."""
    import xgrammar

    return xgrammar


def check_syntax(structured: StructuredOutput) -> None:
    """ValueError naming the kind and saying what is wrong (xgrammar's message) if the
    grammar of ``structured`` cannot be built. A choice always can."""
    if structured.kind == GrammarKind.CHOICE:
        return
    grammar = load().Grammar
    builders = {
        GrammarKind.JSON_SCHEMA: lambda spec: grammar.from_json_schema(
            spec, any_whitespace=structured.any_whitespace),
        GrammarKind.JSON_OBJECT: lambda spec: grammar.builtin_json_grammar(),
        GrammarKind.REGEX: grammar.from_regex,
        GrammarKind.GRAMMAR: grammar.from_ebnf,
        GrammarKind.STRUCTURAL_TAG: grammar.from_structural_tag,
    }
    try:
        builders[structured.kind](structured.spec)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors are RuntimeErrors
        message = re.sub(r"\s+", " ", _CPP_PREFIX.sub("", str(exc))).strip()
        raise ValueError(f"invalid {structured.kind.value}: {message[:500]}") from None
