"""Constrained output with llguidance: response formats -> grammars, and each constrained row's
matcher, whose allowed tokens the host computes as a bitmask before each of the row's steps.

The sampler turns the bitmask into a boolean mask with MLX ops (sampling.allowed_mask), so it works
on every backend (llguidance's own MLX kernel is Metal-only). A row's matcher advances on the host
by the token the row outputs (OutputProcessor.accept), before its next mask is computed.
"""
from __future__ import annotations

import json
from copy import copy
from typing import Any, Optional

import numpy as np

from kvbatch.engine import errors
from kvbatch.engine.errors import RowError

# the response formats grammar_from_format takes (besides a JSON schema itself)
FORMAT_TYPES = ("json_object", "json_schema", "regex")


def _llg():
    import llguidance  # imported on first use: a run without constrained rows never loads it

    return llguidance


def grammar_from_format(fmt: Any) -> str:
    """A response format -> llguidance grammar text (SamplingParams.grammar). Accepted:
    "json_object" or {"type": "json_object"} (any JSON object); {"type": "json_schema",
    "json_schema": {"schema": S}} (OpenAI's form) or {"type": "json_schema", "schema": S};
    {"type": "regex", "regex": R} or "regex:R"; a JSON schema itself (a mapping, or its JSON text).
    Raises ValueError with one line: what is wrong, llguidance's own message for a schema or regex
    it rejects."""
    M = _llg().LLMatcher
    if isinstance(fmt, str):
        text = fmt.strip()
        if text == "json_object":
            fmt = {"type": "json_object"}
        elif text.startswith("regex:"):
            fmt = {"type": "regex", "regex": text[len("regex:"):]}
        elif text.startswith("{"):
            try:
                fmt = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"response_format is not valid JSON ({exc.msg} at character {exc.pos})") from None
        else:
            raise ValueError(f"response_format {text[:80]!r}: use json_object, regex:PATTERN, "
                             "a JSON schema, or {type: json_schema | json_object | regex, ...}")
    if not isinstance(fmt, dict):
        raise ValueError(f"response_format must be a string or a mapping, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "json_object":
        grammar = M.grammar_from_json_schema({"type": "object"})
    elif kind == "regex":
        if not isinstance(fmt.get("regex"), str):
            raise ValueError("response_format of type regex needs a 'regex' string")
        grammar = M.grammar_from_regex(fmt["regex"])
    else:
        schema = fmt
        if kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else fmt.get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format of type json_schema needs a 'schema' mapping "
                                 "(or json_schema: {schema: ...})")
        try:
            grammar = M.grammar_from_json_schema(schema)
        except ValueError as exc:
            raise ValueError(f"response_format: {exc}") from None
    problem = M.validate_grammar(grammar)
    if problem:
        raise ValueError(f"response_format rejected by llguidance: {one_line(problem)}")
    return grammar


def one_line(message: str) -> str:
    """llguidance's message on one line: its first line and its `error:` lines (not the source listing)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    why = [ln[len("error:"):].strip() for ln in lines[1:] if ln.startswith("error:")]
    return lines[0].rstrip(":") + (": " + "; ".join(why) if why else "")


class Grammars:
    """An engine's grammar side: the llguidance tokenizer (built on the first constrained row,
    ~0.5 s for a 49k vocabulary), each grammar compiled once (a row's matcher is a copy), and
    the thread pool that fills many rows' masks in one call."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]):
        self._tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None
        self._compiled: dict[str, Any] = {}
        self._executor = None

    @property
    def words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + 31) // 32

    def _tok(self):
        if self._lltok is None:
            llg = _llg()
            # the `tokenizers` Tokenizer behind kvbatch's tokenizer or transformers' fast one, serialized as
            # llguidance.hf.from_tokenizer does (which would import transformers)
            backend = getattr(self._tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise RowError(errors.INVALID_INPUT, "constrained output needs a fast (tokenizer.json) tokenizer")
            backend = copy(backend)
            backend.no_padding()
            backend.no_truncation()
            eos = self.eos_ids or getattr(self._tokenizer, "eos_token_id", None)
            try:
                self._lltok = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            except ValueError as exc:
                raise RowError(errors.INVALID_INPUT, f"constrained output cannot use this tokenizer: {exc}") from None
            self._executor = llg.LLExecutor()
        return self._lltok

    def matcher(self, grammar: str):
        """A fresh matcher for a row; RowError(invalid_input) when llguidance rejects the grammar."""
        proto = self._compiled.get(grammar)
        if proto is None:
            proto = _llg().LLMatcher(self._tok(), grammar, log_level=0)
            if proto.is_error():
                raise RowError(errors.INVALID_INPUT, f"response_format rejected by llguidance: "
                                                     f"{one_line(proto.get_error())}")
            self._compiled[grammar] = proto
        return proto.deep_copy()

    def fill(self, bitmask: np.ndarray, rows: list[tuple[Any, int]]) -> None:
        """Write each (matcher, index) row's allowed tokens into bitmask[index] (int32, (B, words))."""
        from llguidance.numpy import fill_next_token_bitmask_par

        assert self._executor is not None  # made with the tokenizer (_tok), before any matcher
        fill_next_token_bitmask_par(self._executor, rows, bitmask)


def advance(matcher: Any, token: int) -> Optional[str]:
    """Feed a row's output token to its matcher; the error when the matcher refuses it."""
    if matcher.consume_token(token):
        return None
    return one_line(matcher.get_error()) if matcher.get_error() else f"token {token} is not allowed by the grammar"
