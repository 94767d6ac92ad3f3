"""What a request's output must match: the contract between the API and the engine.

The API turns ``response_format``, ``structured_outputs``, the ``guided_*`` fields and the
tool-call choices into one `StructuredOutput`; the engine compiles it for its tokenizer
(`workers.structured`) and masks every sampled token of the request with it. The spec is plain
text, so it crosses processes as it is and is the key of the compiled-grammar cache.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Tuple

# A spec this long (schema, regex, grammar or structural tag, in characters) is refused: its
# compilation time and memory grow with it.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# How deep the objects and arrays of a JSON spec (schema, structural tag) may nest: 128 is 64
# schema levels (an object and its ``properties`` each), past any real schema. xgrammar's time
# grows with the cube of the depth (tens of milliseconds at 128, minutes at 1000), and Python's
# JSON parser recurses.
MAX_JSON_DEPTH = 128

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NESTING = {"{": 1, "[": 1, "}": -1, "]": -1}


def json_depth(text: str) -> int:
    """How deep the objects and arrays of the JSON ``text`` nest (0 for a scalar), counted
    without parsing it."""
    brackets = _JSON_STRING.sub("", text)
    return max(accumulate(_NESTING.get(c, 0) for c in brackets), default=0)


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec empty
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # spec: an EBNF (GBNF) grammar whose root rule is ``root``
    STRUCTURAL_TAG = "structural_tag"  # spec: an xgrammar structural tag, as JSON (tool calls)


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint. ``any_whitespace`` False allows only the canonical
    whitespace between JSON tokens (vLLM's ``disable_any_whitespace``); it applies to the JSON
    kinds. Checked on construction: ``ValueError`` says what is wrong; whether a schema, regex or
    grammar compiles is known only when it is compiled."""

    kind: GrammarKind
    spec: str = ""
    choices: Tuple[str, ...] = ()
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))
        if not isinstance(self.spec, str):
            raise ValueError(f"a {self.kind.value} spec must be text, got "
                             f"{type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind.value} is {len(self.spec)} characters; at most "
                             f"{MAX_SPEC_CHARS} are accepted")
        if self.kind == GrammarKind.CHOICE:
            self._check_choices()
        elif self.kind == GrammarKind.JSON_OBJECT:
            if self.spec:
                raise ValueError("a json_object constraint takes no spec")
        elif not self.spec:
            raise ValueError(f"a {self.kind.value} constraint needs a non-empty spec")
        if self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG):
            self._check_json_object()

    def _check_choices(self) -> None:
        if not self.choices or len(self.choices) > MAX_CHOICES:
            raise ValueError(f"choice needs 1 to {MAX_CHOICES} strings, got "
                             f"{len(self.choices)}")
        if any(not isinstance(c, str) or not c for c in self.choices):
            raise ValueError(f"choices must be non-empty strings, got {self.choices!r:.200}")
        if sum(map(len, self.choices)) > MAX_SPEC_CHARS:
            raise ValueError(f"choices of at most {MAX_SPEC_CHARS} characters in all")

    def _check_json_object(self) -> None:
        depth = json_depth(self.spec)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"the {self.kind.value} nests {depth} objects and arrays deep; at "
                             f"most {MAX_JSON_DEPTH} are accepted")
        try:
            value = json.loads(self.spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the {self.kind.value} is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)) or (self.kind == GrammarKind.STRUCTURAL_TAG
                                                   and not isinstance(value, dict)):
            raise ValueError(f"the {self.kind.value} must be a JSON object, got "
                             f"{type(value).__name__}")

    @property
    def cache_key(self) -> Tuple[str, str, Tuple[str, ...], bool]:
        return (self.kind.value, self.spec, self.choices, self.any_whitespace)
