"""`job.response_format` and the per-row `response_format` column: read once into the form the queue
stores, and turned into the llguidance grammar the engine runs (engine/grammar.py).

A value is "text" (free output: a row's way out of a job's format), "json_object", "regex:PATTERN",
a JSON schema (a mapping, or its JSON text), one of the OpenAI-style mappings ({type: json_schema,
json_schema: {schema: ...}}, {type: json_object}, {type: regex, regex: ...}), or (job.response_format only,
never a row's) the path of a JSON file holding a schema: relative to the working directory, else to the
project root, as job.input; a regular file of at most MAX_FILE_BYTES, read once.
Every value is compiled once when it is read, so a schema llguidance rejects is a one-line error at
start (job level) or `invalid_input` (a row).
"""
from __future__ import annotations

import json
import stat
from functools import lru_cache
from typing import Any, Optional

from kvbatch.engine.grammar import grammar_from_format
from kvbatch.pipeline import paths


MAX_FILE_BYTES = 1 << 20  # a schema file larger than this is refused (a schema is a few KB)


@lru_cache(maxsize=64)
def _schema_file(path: str) -> Any:
    """The schema in job.response_format's file, read once: a regular file only (never a FIFO, a device or
    a directory, which could hang or exhaust the process), at most MAX_FILE_BYTES."""
    try:
        resolved = paths.resolve(path)
        if not resolved.exists():
            raise FileNotFoundError(path)
        if not stat.S_ISREG(resolved.stat().st_mode):
            raise ValueError(f"response_format {path!r} is not json_object, regex:..., or JSON, and as a schema "
                             f"file: not a regular file")
        with open(resolved, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"response_format file {str(resolved)!r} is larger than {MAX_FILE_BYTES} bytes")
        text = data.decode("utf-8-sig")
    except (OSError, RuntimeError, UnicodeDecodeError) as exc:
        why = "no such file" if isinstance(exc, FileNotFoundError) else f"cannot read it ({exc})"
        raise ValueError(f"response_format {path!r} is not json_object, regex:..., or JSON, and as a schema "
                         f"file: {why}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"response_format file {str(resolved)!r} is not JSON ({exc.msg}, line {exc.lineno})") \
            from None


def resolve(value: Any, files: bool = True) -> Optional[Any]:
    """The format as it runs (None: not set; "text": free output): "json_object", "regex:...", or a mapping (JSON text
    parsed, a file read). Raises ValueError with one line when it is unusable or llguidance rejects it.
    `files=False` (a row's value): never a path; rows never name files, only the job does."""
    if value is None:
        return None
    if hasattr(value, "items") and not isinstance(value, dict):  # an OmegaConf node from the config
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(value, resolve=True)
    if value == "text" or value == {"type": "text"}:  # OpenAI's "free text": a row unconstrained in a constrained job
        return "text"
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"response_format is not valid JSON ({exc.msg} at character {exc.pos})") from None
        elif text != "json_object" and not text.startswith("regex:"):
            if not files:
                raise ValueError(f"response_format must be text, json_object, regex:PATTERN or a JSON schema, got "
                                 f"{text[:80]!r} (a row never names a file: set a schema file as job.response_format)")
            value = _schema_file(text)
    grammar(value)
    return value


def canonical(value: Any) -> Optional[str]:
    """A resolved format as one JSON text (the results' response_format column, the grammar cache key, the
    config hash). Keys keep the order they were written in: a schema's property order is the order the
    fields are generated in ({reasoning, answer} reasons before it answers), so two orders are two formats."""
    return None if value is None else json.dumps(value, ensure_ascii=False)


def grammar(value: Any) -> Optional[str]:
    """The llguidance grammar of a resolved format (compiled once per distinct format); None: free text."""
    return None if value is None or value == "text" else _grammar(canonical(value))


@lru_cache(maxsize=256)
def _grammar(text: str) -> str:
    return grammar_from_format(json.loads(text))  # dicts keep the text's key order: the schema as written
