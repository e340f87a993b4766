"""Read a job's input rows (JSONL, CSV, Parquet) into queue payloads with stable row keys.

File-level problems (missing file, unknown format, no prompt/messages column at all)
raise ConfigError before the model loads. Row-level problems (a malformed JSON line,
a missing or non-string prompt, bad per-row max_tokens/temperature/seed) become a
payload with an `error` message: that row is written with `invalid_input` and never
reaches the engine, and every other row goes on.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from kvbatch.pipeline.config import ConfigError, JobConfig

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
            ".parquet": "parquet", ".pq": "parquet"}
PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class InputRow:
    pos: int  # 0-based position in the input (input order of results.parquet)
    key: str  # stable row key: the id column, else a hash of position + content
    payload: dict  # prompt|messages, overrides, or error; JSON-serialisable (stored in the queue)


def resolve_input(path: str) -> Path:
    """Relative paths: the working directory first, then the project root (for jobs/ samples)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    alt = PROJECT_ROOT / p
    return alt.resolve() if alt.exists() else p.resolve()


def detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    found = SUFFIXES.get(path.suffix.lower())
    if found is None:
        raise ConfigError(f"job.input={str(path)!r}: cannot tell the format from the suffix "
                          f"'{path.suffix}'; set job.format to jsonl, csv or parquet")
    return found


def _jsonl(path: Path) -> Iterator[tuple[Optional[dict], str]]:
    """(parsed object or None, raw text) per non-blank line."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            raw = line.strip()
            if not raw:
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                yield {"__error__": f"line {lineno}: malformed JSON ({exc.msg})"}, raw
                continue
            if not isinstance(obj, dict):
                yield {"__error__": f"line {lineno}: not a JSON object ({type(obj).__name__})"}, raw
                continue
            yield obj, raw


def _csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="", encoding="utf-8", errors="replace") as fh:
        reader = csv.DictReader(fh)
        rows = [{k: (None if v == "" else v) for k, v in r.items() if k is not None} for r in reader]
        return list(reader.fieldnames or []), rows


def _parquet(path: Path) -> tuple[list[str], list[dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ConfigError(f"job.input={str(path)!r}: cannot read as Parquet: {str(exc).splitlines()[0]}") from None
    return table.column_names, table.to_pylist()


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, str):
        try:
            v = float(v.strip()) if "." in v or "e" in v.lower() else int(v.strip())
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {int(v)}")
    return int(v)


def _float(name: str, v: Any) -> float:
    try:
        if isinstance(v, bool):
            raise ValueError
        f = float(v.strip() if isinstance(v, str) else v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return f


def _messages(v: Any) -> list:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise ValueError("messages is a string but not JSON") from None
    ok = isinstance(v, list) and v and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)
    if not ok:
        raise ValueError("messages must be a non-empty list of {role, content} string pairs")
    if not any(m["content"].strip() for m in v):
        raise ValueError("messages have no content")
    return [{"role": m["role"], "content": m["content"]} for m in v]


def row_payload(row: dict, job: JobConfig) -> dict:
    """Validate one parsed row; return its payload (an `error` key when the row is unusable)."""
    out: dict = {}
    try:
        prompt, msgs = row.get(job.prompt_column), row.get(job.messages_column)
        if not _missing(prompt):
            out["prompt"] = prompt if isinstance(prompt, str) else repr(prompt)
            if not isinstance(prompt, str):
                raise ValueError(f"{job.prompt_column} must be a string, got {type(prompt).__name__}")
            if not prompt.strip():
                raise ValueError(f"empty {job.prompt_column}")
        elif not _missing(msgs):
            out["prompt"] = msgs if isinstance(msgs, str) else json.dumps(msgs, ensure_ascii=False, default=str)
            out["messages"] = _messages(msgs)
        else:
            raise ValueError(f"row has no {job.prompt_column!r} or {job.messages_column!r}")
        if not _missing(row.get("max_tokens")):
            out["max_tokens"] = _int("max_tokens", row["max_tokens"], 1)
        if not _missing(row.get("temperature")):
            out["temperature"] = _float("temperature", row["temperature"])
        if not _missing(row.get("seed")):
            out["seed"] = _int("seed", row["seed"], 0)
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def _key(pos: int, content: str) -> str:
    return hashlib.sha256(f"{pos}\n{content}".encode()).hexdigest()[:16]


def read_rows(path: Path, fmt: str, job: JobConfig) -> list[InputRow]:
    """All rows of the input, in order, each with its key and payload."""
    if not path.is_file():
        raise ConfigError(f"job.input={str(path)!r}: no such file")
    fmt = detect_format(path, fmt)
    if fmt == "jsonl":
        items = list(_jsonl(path))
        parsed = [o for o, _ in items if "__error__" not in o]
        columns = set().union(*[o.keys() for o in parsed]) if parsed else None
        records = [(o, raw) for o, raw in items]
    else:
        names, rows = _csv(path) if fmt == "csv" else _parquet(path)
        columns = set(names) if names or rows else None
        records = [(r, None) for r in rows]
    if columns is not None and not ({job.prompt_column, job.messages_column} & columns):
        raise ConfigError(f"job.prompt_column={job.prompt_column!r}: no such column in {path.name} "
                          f"(nor job.messages_column={job.messages_column!r}); columns: {sorted(columns)}")
    out: list[InputRow] = []
    seen: dict[str, int] = {}
    for pos, (obj, raw) in enumerate(records):
        if "__error__" in obj:
            out.append(InputRow(pos, _key(pos, raw), {"prompt": raw, "error": obj["__error__"]}))
            continue
        payload = row_payload(obj, job)
        rid = obj.get(job.id_column)
        if _missing(rid) or (isinstance(rid, str) and not rid.strip()):
            key = _key(pos, json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False))
        else:
            key = str(int(rid) if isinstance(rid, float) and rid.is_integer() else rid)
            if key in seen:
                payload.setdefault("error", f"duplicate {job.id_column} {key!r} (first at row {seen[key]})")
                key = f"{key}#{pos}"
            else:
                seen[key] = pos
        out.append(InputRow(pos, key, payload))
    return out
