"""Read a job's input rows (JSONL, CSV, Parquet) into queue payloads with stable row keys.

File-level problems (missing file, unknown format, no prompt/messages column at all)
raise ConfigError before the model loads. Row-level problems (a malformed JSON line,
a missing or non-string prompt, a bad per-row parameter or response_format, NaN, text that
is not valid Unicode, nesting too deep to parse, anything else that fails on one row)
become a payload with an `error` message: that row is written with `invalid_input` and
never reaches the engine, and every other row goes on. A UTF-8 byte-order mark is
skipped; CSV fields have no size limit (a huge prompt gets `prompt_too_long` later).
Row keys are unique: a repeated id gets `ID#POS` (more `#` until no real id has it).
"""
from __future__ import annotations

import csv
import hashlib
import os
import stat
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from kvbatch.engine.params import INT32_MAX
from kvbatch.pipeline import chat, paths, row_params
from kvbatch.pipeline.config import ConfigError, JobConfig
from kvbatch.pipeline.formats import openai_batch, shapes

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
            ".parquet": "parquet", ".pq": "parquet"}


@dataclass
class InputRow:
    """One input row as queued: its position, stable key and JSON payload."""

    pos: int  # 0-based position in the input (input order of results.parquet)
    key: str  # stable row key: the id column, else a hash of position + content
    payload: dict  # prompt|messages, overrides, or error; JSON-serialisable (stored in the queue)


def resolve_input(path: str) -> Path:
    """Relative paths: the working directory first, then the project root (for jobs/ samples)."""
    try:
        return paths.resolve(path)
    except (RuntimeError, OSError) as exc:  # a symlink loop, an unreadable parent
        raise ConfigError(f"job.input={path!r}: cannot resolve the path ({exc})") from None


def detect_format(path: Path, fmt: str) -> str:
    """The input's format: job.format, or when auto the file's suffix (an OpenAI batch file by its first line)."""
    if fmt != "auto":
        return fmt
    found = SUFFIXES.get(path.suffix.lower())
    if found == "jsonl" and openai_batch.sniff(path):
        return "openai_batch"
    if found is None:
        raise ConfigError(f"job.input={str(path)!r}: cannot tell the format from the suffix "
                          f"'{path.suffix}'; set job.format to jsonl, csv, parquet or openai_batch")
    return found


def _bad_utf8(data: bytes, exc: UnicodeDecodeError, offset: int) -> str:
    """Where text stops being UTF-8: the byte and its offset in the file."""
    return (f"not valid UTF-8 (byte 0x{data[exc.start]:02X} at byte offset {offset + exc.start} of the file); "
            f"save the file as UTF-8")


def _jsonl(path: Path) -> Iterator[tuple[dict, str]]:
    """(parsed object, or {"__error__": why} for a line that is not one, raw text) per non-blank line;
    a .json file holding one top-level array: per element. A line that is not UTF-8 is that row's
    error, never decoded with replacement characters."""
    if path.suffix.lower() == ".json":
        with open(path, "rb") as fh:
            head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        items = _json_array(path) if head.startswith(b"[") else None
        if items is not None:  # else one JSON value a line after all
            yield from items
            return
    offset = 0
    with open(path, "rb") as fh:
        for lineno, data in enumerate(fh, 1):
            start, offset = offset, offset + len(data)
            if lineno == 1 and data.startswith(b"\xef\xbb\xbf"):
                data, start = data[3:], start + 3
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield {**_clean_fields(data), "__error__": f"line {lineno}: {_bad_utf8(data, exc, start)}"}, \
                    data.decode("utf-8", "backslashreplace").strip()
                continue
            raw = line.strip()
            if not raw:
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                yield {"__error__": f"line {lineno}: malformed JSON ({exc.msg})"}, raw
                continue
            except RecursionError:
                yield {"__error__": f"line {lineno}: JSON nested too deeply to read"}, raw[:1000]
                continue
            except ValueError as exc:  # an integer of more digits than Python converts (4,300)
                yield {"__error__": f"line {lineno}: unreadable JSON ({str(exc).split(';')[0]})"}, raw[:1000]
                continue
            if not isinstance(obj, dict):
                yield {"__error__": f"line {lineno}: not a JSON object ({type(obj).__name__})"}, raw
                continue
            yield obj, raw


def _clean_fields(data: bytes) -> dict:
    """The text fields of a line that is not all UTF-8 that are (its id: the row keeps its key)."""
    try:
        obj = json.loads(data.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return {}
    return {k: v for k, v in obj.items() if isinstance(v, str) and not _BAD.search(k + v)} \
        if isinstance(obj, dict) else {}


def _json_array(path: Path) -> Optional[list[tuple[dict, str]]]:
    """The elements of a .json file that is one JSON array (the Alpaca dataset as distributed); read
    whole, so a file that is not one valid array is refused at start, naming where. None: the array
    is followed by more values (a file of one JSON value a line)."""
    data = path.read_bytes()
    try:
        items = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"job.input={str(path)!r}: {_bad_utf8(data, exc, 0)}") from None
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            return None
        raise ConfigError(f"job.input={str(path)!r}: a JSON array that is not valid JSON ({exc.msg}, line "
                          f"{exc.lineno} column {exc.colno}); a file of one object a line is JSONL") from None
    except RecursionError:
        raise ConfigError(f"job.input={str(path)!r}: JSON nested too deeply to read") from None
    if not isinstance(items, list):
        raise ConfigError(f"job.input={str(path)!r}: not a JSON array nor one JSON object a line")
    return [(obj, json.dumps(obj, ensure_ascii=False, default=str)) if isinstance(obj, dict) else
            ({"__error__": f"element {i}: not a JSON object ({type(obj).__name__})"},
             json.dumps(obj, ensure_ascii=False, default=str)) for i, obj in enumerate(items)]


def _csv(path: Path) -> tuple[list[str], list[dict]]:
    """The header and the rows. A header naming a column twice is refused (one would be lost); a row
    with bytes that are not UTF-8 is that row's error ({"__error__": why}), never decoded with
    replacement characters."""
    csv.field_size_limit(INT32_MAX)  # the default (131,072 characters) would fail the whole file
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
        reader = csv.DictReader(fh)
        try:
            rows = [_csv_row(r, reader.line_num) for r in reader]
        except csv.Error as exc:
            raise ConfigError(f"job.input={str(path)!r}: not readable as CSV at line {reader.line_num}: {exc}") \
                from None
        names = list(reader.fieldnames or [])
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"job.input={str(path)!r}: the header names {', '.join(map(repr, twice))} more than "
                              f"once (only the last such column would be read); rename them")
        if any(_BAD.search(n) for n in names):
            raise ConfigError(f"job.input={str(path)!r}: the header is not valid UTF-8; save the file as UTF-8")
        return names, rows


_BAD = re.compile("[\udc80-\udcff]")  # a byte that was not UTF-8 (errors="surrogateescape")


def _csv_row(r: dict, line: int) -> dict:
    row = {k: (None if v == "" else v) for k, v in r.items() if k is not None}
    for k, v in row.items():
        m = _BAD.search(v) if isinstance(v, str) else None
        if m:
            byte = ord(m.group()) - 0xDC00
            return {"__error__": f"line {line}: column {k!r} is not valid UTF-8 (byte 0x{byte:02X}); save the file "
                                 f"as UTF-8"}
    return row


def _parquet(path: Path) -> tuple[list[str], list[dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ConfigError(f"job.input={str(path)!r}: cannot read as Parquet: {str(exc).splitlines()[0]}") from None
    try:
        return table.column_names, table.to_pylist()
    except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: those rows only
        return table.column_names, [_parquet_row(table, i) for i in range(table.num_rows)]


def _parquet_row(table, i: int) -> dict:
    """Row i; one whose strings are not all UTF-8 is unreadable (invalid_input), its id kept where it is one."""
    try:
        return table.slice(i, 1).to_pylist()[0]
    except UnicodeDecodeError:
        row: dict = {}
        for name in table.column_names:
            try:
                row[name] = table.column(name)[i].as_py()
            except UnicodeDecodeError:
                pass
        return {**row, "__error__": f"row {i}: a string column holds bytes that are not UTF-8"}


def _missing(v: Any) -> bool:
    """No value: None (JSON null, an empty CSV field, a Parquet null). NaN is a value (refused where a
    number is read): pandas and pyarrow write a missing float as null, so a NaN was put there."""
    return v is None


def _messages(v: Any) -> list:
    return chat.read_messages(v)  # {role, content} pairs; OpenAI content parts joined (pipeline/chat.py)


def row_payload(row: dict, job: JobConfig, scored: tuple[str, ...] = ()) -> dict:
    """Validate one parsed row; return its payload (an `error` key when the row is unusable). `scored`:
    action=score's completion columns, read into the payload (pipeline/score.py)."""
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
        out.update(row_params.parse(row))
        if scored:
            out.update(score_texts(row, scored))
    except ValueError as exc:
        out["error"] = str(exc)
    return out


TEXTS = "score_texts"  # an input row's payload under action=score: column -> its completion
BAD = "score_errors"  # ... column -> why its value cannot be scored (pipeline/score.py)


def score_texts(row: dict, columns: tuple[str, ...]) -> dict:
    """action=score: the completion columns of one parsed input row, for its payload (TEXTS and BAD)."""
    texts: dict[str, str] = {}
    bad: dict[str, str] = {}
    for col in columns:
        v = row.get(col)
        if _missing(v):
            bad[col] = f"row has no {col!r} column to score (job.score_columns)"
        elif not isinstance(v, str):
            bad[col] = f"{col} must be a string to score, got {type(v).__name__}"
        elif not v:
            bad[col] = f"empty {col}: nothing to score"
        else:
            texts[col] = v
    return {TEXTS: texts, BAD: bad}


def _key(pos: int, content: str) -> str:
    return hashlib.sha256(f"{pos}\n{content}".encode("utf-8", "backslashreplace")).hexdigest()[:16]


def _unicode_safe(payload: dict) -> dict:
    """The payload as stored in the queue must be valid UTF-8: a lone surrogate (JSON "\\ud800")
    cannot be, so such a row becomes invalid_input, its text shown with the surrogate escaped."""
    try:
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
        return payload
    except UnicodeEncodeError:
        shown = payload.get("prompt")
        if isinstance(shown, str):
            shown = shown.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"prompt": shown, "error": "not valid Unicode text (it holds a lone surrogate such as \\udc00)"}


def _row(pos: int, obj: dict, raw: Optional[str], job: JobConfig,
         scored: tuple[str, ...] = ()) -> tuple[Optional[str], str, dict]:
    """(the row's id or None, its content hash key, its payload) for one parsed row."""
    if "__error__" in obj:  # unreadable; an OpenAI batch request keeps its custom_id
        rid = obj.get(job.id_column) if isinstance(obj.get(job.id_column), str) else None
        return rid, _key(pos, raw or ""), _unicode_safe({"prompt": raw, "error": obj["__error__"]})
    payload = _unicode_safe(row_payload(obj, job, scored))
    if "error" not in payload and not _utf8(obj):  # a carried column: this row's problem, not its column's
        payload = {"prompt": payload.get("prompt"),
                   "error": "not valid Unicode text in a column (it holds a lone surrogate such as \\udc00)"}
    rid = obj.get(job.id_column)
    hashed = _key(pos, json.dumps(obj, sort_keys=True, default=str, ensure_ascii=False))
    if rid is None or (isinstance(rid, float) and math.isnan(rid)) or (isinstance(rid, str) and not rid.strip()):
        return None, hashed, payload
    rid = str(int(rid) if isinstance(rid, float) and rid.is_integer() else rid)
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:
        rid = rid.encode("utf-8", "backslashreplace").decode("utf-8")
        payload = {"prompt": payload.get("prompt"),
                   "error": f"{job.id_column} is not valid Unicode text (it holds a lone surrogate)"}
    if "\x00" in rid:  # no text column of PostgreSQL holds U+0000
        rid = rid.replace("\x00", "\\u0000")
        payload = {"prompt": payload.get("prompt"), "error": f"{job.id_column} holds the character U+0000"}
    return rid, hashed, payload


def _utf8(obj: Any) -> bool:
    """Whether every text in a parsed row can be written as UTF-8 (no lone surrogate)."""
    try:
        json.dumps(obj, ensure_ascii=False, default=str).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
    except (ValueError, TypeError, RecursionError):  # not for this check to judge: _row's own reading does
        return True


def _guarded_row(pos: int, obj: dict, raw: Optional[str], job: JobConfig,
                 scored: tuple[str, ...] = ()) -> tuple[Optional[str], str, dict]:
    """One row can never stop the job: whatever fails while reading it makes it invalid_input."""
    try:
        return _row(pos, obj, raw, job, scored)
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        why = "nested too deeply to read" if isinstance(exc, RecursionError) else f"{type(exc).__name__}: {exc}"
        text = (raw or repr(obj)[:1000]).encode("utf-8", "backslashreplace").decode("utf-8")
        return None, _key(pos, text), {"prompt": text, "error": f"cannot read this row: {why}"}


def _unique_keys(rows: list[tuple[Optional[str], str, dict]], job: JobConfig) -> list[InputRow]:
    """Keys: the id; a repeated id is invalid_input under `ID#POS` (with more `#` until it names no
    other row: ids `dup`, `dup`, `dup#1` keep three distinct keys); rows without an id: the hash."""
    taken = {rid for rid, _, _ in rows if rid is not None}
    seen: dict[str, int] = {}
    out: list[InputRow] = []
    for pos, (rid, hashed, payload) in enumerate(rows):
        if rid is None:
            key = hashed
            while key in taken:  # an id that equals this row's content hash: the id keeps its key
                key += "#"
        elif rid in seen:
            payload = {**payload}
            payload.setdefault("error", f"duplicate {job.id_column} {rid!r} (first at row {seen[rid]})")
            key = f"{rid}#{pos}"
            while key in taken:
                key += "#"
        else:
            seen[rid] = pos
            key = rid
        taken.add(key)
        out.append(InputRow(pos, key, payload))
    return out


def _input_file(path: Path) -> None:
    """The input must be a regular file (not missing, a directory, a FIFO, a symlink loop)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"job.input={str(path)!r}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"job.input={str(path)!r}: cannot open ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"job.input={str(path)!r}: not a regular file")


def read_rows(path: Path, fmt: str, job: JobConfig, scored: tuple[str, ...] = ()) -> list[InputRow]:
    """All rows of the input, in order, each with its key and payload (`scored`: row_payload's)."""
    _input_file(path)
    fmt = detect_format(path, fmt)
    try:
        if fmt in ("jsonl", "openai_batch"):
            items = list(_jsonl(path))
            if fmt == "openai_batch":  # requests mapped to kvbatch's columns (pipeline/formats/openai_batch.py)
                items = [(o if "__error__" in o else openai_batch.to_row(o, job.id_column, job.messages_column),
                          raw) for o, raw in items]
            parsed = [o for o, _ in items if "__error__" not in o]
            columns = set().union(*[o.keys() for o in parsed]) if parsed else None
            records = [(o, raw) for o, raw in items]
        else:
            names, rows = _csv(path) if fmt == "csv" else _parquet(path)
            columns = set(names) if names or rows else None
            records = [(r, repr(r)[:1000] if "__error__" in r else None) for r in rows]
    except OSError as exc:
        raise ConfigError(f"job.input={str(path)!r}: cannot read ({exc.strerror or exc})") from None
    if columns is not None and job.shape != "columns":  # ShareGPT / Alpaca (pipeline/formats/shapes.py)
        shapes.check(job, columns, path.name)
    if job.shape != "columns":
        records = [(o if "__error__" in o else shapes.to_row(o, job), raw) for o, raw in records]
    elif columns is not None and not ({job.prompt_column, job.messages_column} & columns):
        raise ConfigError(f"job.prompt_column={job.prompt_column!r}: no such column in {path.name} "
                          f"(nor job.messages_column={job.messages_column!r}); columns: {sorted(columns, key=str)}")
    absent = [c for c in scored if columns is not None and c not in columns]
    if absent:  # no row has it: the setting names the wrong column (a row without it: invalid_input)
        raise ConfigError(f"job.score_columns={list(scored)}: no column {', '.join(map(repr, absent))} in "
                          f"{path.name} to score; columns: {sorted(columns or (), key=str)}")
    return _unique_keys([_guarded_row(pos, obj, raw, job, scored) for pos, (obj, raw) in enumerate(records)], job)
