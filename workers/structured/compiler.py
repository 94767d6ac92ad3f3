"""Grammars compiled for one engine's tokenizer, with a bounded cache.

`GrammarCache.compile` turns a `StructuredOutput` into an xgrammar ``CompiledGrammar`` for the
engine's tokenizer and vocabulary (the model's embedding rows, which may exceed the tokenizer's
tokens: ids past the tokenizer's are never allowed). xgrammar is imported, and its tokenizer
table built, on the first compile: an engine that never sees a constrained request never pays
for it.

Guarantees: a spec that does not compile raises ``ValueError`` naming its kind and xgrammar's
message (a 400 upstream), never another exception. The cache holds compiled grammars keyed by
``StructuredOutput.cache_key``, least recently used first out, within ``max_bytes`` of their
``memory_size_bytes`` (default 256 MiB; a grammar larger than the bound is returned, not kept).
Thread-safe: the serving engine compiles on a small thread pool while its engine thread reads
nothing here but the compiled results it is handed.
Cost: a JSON schema of a dozen fields compiles in tens of milliseconds for a 49k vocabulary; a
cache hit is a dictionary lookup.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

from workers.structured.spec import GrammarKind, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices``, each taken literally (every character that
    means something to a regex escaped)."""
    return "(" + "|".join(_escape(choice) for choice in choices) + ")"


def _escape(text: str) -> str:
    # xgrammar's regex dialect is ECMAScript's: escape every punctuation character, keep the rest.
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/-" else _escape_control(c) for c in text)


def _escape_control(c: str) -> str:
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 else c


class GrammarCache:
    """Compiles `StructuredOutput`s for ``tokenizer`` (a ``transformers`` tokenizer) and a model
    of ``vocab_size`` logits; ``stop_token_ids`` end a complete output (the model's EOS ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this checkpoint "
                             "has no tokenizer files")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._compiler: Optional["xgr.GrammarCompiler"] = None
        self._cache: "collections.OrderedDict[tuple, xgr.CompiledGrammar]" = (
            collections.OrderedDict())
        self._num_bytes = 0

    @property
    def num_bytes(self) -> int:
        """Bytes of the grammars cached now (at most ``max_bytes``)."""
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, structured: StructuredOutput) -> "xgr.CompiledGrammar":
        """The compiled grammar of ``structured`` (from the cache when it is there)."""
        key = structured.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(self._get_compiler(), structured)
        self._keep(key, compiled)
        return compiled

    def _get_compiler(self) -> "xgr.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                # Cached here, by the request's spec; xgrammar's own cache would hold them twice.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    @staticmethod
    def _compile(compiler: "xgr.GrammarCompiler",
                 structured: StructuredOutput) -> "xgr.CompiledGrammar":
        kind, spec = structured.kind, structured.spec
        try:
            if kind == GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(spec,
                                                    any_whitespace=structured.any_whitespace)
            if kind == GrammarKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=structured.any_whitespace,
                                                    strict_mode=False)
            if kind == GrammarKind.REGEX:
                return compiler.compile_regex(spec)
            if kind == GrammarKind.CHOICE:
                return compiler.compile_regex(choice_regex(structured.choices))
            if kind == GrammarKind.GRAMMAR:
                return compiler.compile_grammar(spec, root_rule_name="root")
            if kind == GrammarKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(json.loads(spec))
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            # xgrammar prefixes its messages with a time and its C++ source location.
            message = re.sub(r"\s+", " ", _XGR_PREFIX.sub("", str(exc))).strip()
            raise ValueError(f"the {kind.value} does not compile: {message[:500]}") from None
        raise AssertionError(f"unknown grammar kind {kind}")

    def _keep(self, key: tuple, compiled: "xgr.CompiledGrammar") -> None:
        size = compiled.memory_size_bytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._num_bytes += size
            while self._num_bytes > self.max_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._num_bytes -= dropped.memory_size_bytes
