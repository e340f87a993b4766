"""Input columns kvbatch does not use, carried through to results.parquet unchanged.

Users build datasets from the results, so a `category` or `source` column of the input must come
back next to each row's output instead of having to be joined again. At enqueue the job's input is
read once more and every column except those kvbatch uses (the prompt/messages column, the id
column: `row_key` holds it, and the per-row parameters whose values results show otherwise: in columns
of their own, or as sample_index; engine/params.py marks the one carried instead) is written, with
the row keys, to `passthrough.parquet` in the output folder; finalize appends those columns to
results.parquet by row key. Types: a Parquet input's columns keep their Arrow types exactly; JSONL/CSV values get the
types pyarrow infers (CSV cells are strings), and a JSONL column whose values mix types is carried
as JSON text. A column named like one of kvbatch's result columns is carried as `input_<name>`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.engine.params import PARAMS
from kvbatch.pipeline.config import JobConfig
from kvbatch.pipeline.parts import write_atomic
from kvbatch.pipeline.results import COLUMNS

FILE = "passthrough.parquet"
# used by kvbatch (results show their values)
ROW_PARAMS = tuple(p.name for p in PARAMS if not p.carried)


def carried_name(name: str) -> str:
    """The name a carried input column gets in results.parquet (input_<name> when it clashes with a result column)."""
    return f"input_{name}" if name in COLUMNS else name


def _used(job: JobConfig) -> set[str]:
    from kvbatch.pipeline.formats import shapes

    return {job.prompt_column, job.messages_column, job.id_column, *ROW_PARAMS, *shapes.used(job)}


MAX_DEPTH = 16  # a carried column nested deeper is carried as JSON text (Parquet reads ~100 levels back)


def _depth(t: pa.DataType) -> int:
    """How deeply an Arrow type nests (a list of lists of int: 2)."""
    if pa.types.is_struct(t):
        return 1 + max((_depth(t.field(i).type) for i in range(t.num_fields)), default=0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return 1 + _depth(t.value_type)
    if pa.types.is_map(t):
        return 1 + max(_depth(t.key_type), _depth(t.item_type))
    return 0


def _text(v: object) -> Optional[str]:
    """A value as JSON text, writable as UTF-8 (a lone surrogate escaped: it spoils this value only)."""
    if v is None:
        return None
    try:
        text = json.dumps(v, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):  # an integer too long to print, nesting too deep to walk
        text = repr(v)[:1000] if not isinstance(v, (list, dict)) else None
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _escaped(v: object) -> object:
    """A value with every lone surrogate in its texts escaped (\\udc00), so it can be written as UTF-8."""
    if isinstance(v, str):
        return v.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(v, list):
        return [_escaped(x) for x in v]
    if isinstance(v, dict):
        return {_escaped(k): _escaped(x) for k, x in v.items()}
    return v


def _from_records(records: list[Optional[dict]], used: set[str]) -> pa.Table:
    names: dict[str, None] = {}
    for r in records:
        for k in r or ():
            if isinstance(k, str) and k not in used and not k.startswith("__"):
                names.setdefault(k)
    cols = {}
    for name in names:
        values = [(r or {}).get(name) for r in records]
        try:
            try:
                col = pa.array(values)
            except UnicodeEncodeError:  # a lone surrogate: escaped in its own value, the column stays typed
                col = pa.array([_escaped(v) for v in values])
            if _depth(col.type) > MAX_DEPTH:
                raise pa.ArrowInvalid("nested too deeply for Parquet")
            cols[name] = col
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError, RecursionError):
            # mixed types, nesting too deep: as JSON text, value by value
            cols[name] = pa.array([_text(v) for v in values], pa.string())
    return pa.table(cols) if cols else pa.table({})


def extra_columns(path: Path, fmt: str, job: JobConfig, n_rows: int) -> pa.Table:
    """The input's carried columns, one row per input position (len n_rows), not yet renamed."""
    from kvbatch.pipeline import inputs

    used = _used(job)
    if fmt == "openai_batch":  # a request's every field is mapped (or refused): nothing to carry
        return pa.table({})
    if fmt == "parquet":
        table = pq.read_table(path)
        keep = [c for c in table.column_names if c not in used]
        table = table.select(keep)
        for i, col in enumerate(table.columns):  # bytes that are not UTF-8 spoil their own values only
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                try:
                    col.validate(full=True)
                except pa.ArrowInvalid:
                    fixed = [None if b is None else b.decode("utf-8", "replace")
                             for b in col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary())
                             .to_pylist()]
                    table = table.set_column(i, table.field(i).name, pa.array(fixed, pa.string()))
        return table if table.num_rows == n_rows else pa.table({})
    if fmt == "csv":
        _, rows = inputs._csv(path)
        records: list[Optional[dict]] = list(rows)
    else:
        records = [None if "__error__" in obj else obj for obj, _ in inputs._jsonl(path)]
    return _from_records(records, used) if len(records) == n_rows else pa.table({})


def _names(columns: list[str]) -> list[str]:
    """The carried columns' names in results.parquet: carried_name, with more `input_` until each is
    unique (an input with both `output` and `input_output` columns keeps both)."""
    clash = set(COLUMNS) | {"row_key"}
    taken = clash | {c for c in columns if c not in clash}  # a name that clashes with nothing keeps itself
    out = []
    for c in columns:
        if c not in clash:
            out.append(c)
            continue
        name = carried_name(c)
        while name in taken:
            name = f"input_{name}"
        taken.add(name)
        out.append(name)
    return out


def damaged(out_dir: Path) -> Optional[str]:
    """Why the folder's passthrough.parquet cannot be read (None: it can, or there is none)."""
    path = out_dir / FILE
    if not path.exists():
        return None
    try:
        t = pq.read_table(path)
        if "row_key" not in t.column_names:
            return "it has no row_key column"
    except Exception as exc:  # noqa: BLE001 - ArrowInvalid, OSError, ...: any failure means the same
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def write(out_dir: Path, path: Path, fmt: str, job: JobConfig, keys_by_pos: list[list[str]]) -> None:
    """passthrough.parquet for this input (removed when it has no carried columns): keys_by_pos holds
    the row keys of each input position (several: its samples, which all carry its columns)."""
    target = out_dir / FILE
    extra = extra_columns(path, fmt, job, len(keys_by_pos))
    if not extra.num_columns:
        target.unlink(missing_ok=True)
        return
    extra = extra.rename_columns(_names(extra.column_names)).replace_schema_metadata(None)
    if any(len(keys) != 1 for keys in keys_by_pos):
        extra = extra.take(pa.array([pos for pos, keys in enumerate(keys_by_pos) for _ in keys], pa.int64()))
    keys = [k for ks in keys_by_pos for k in ks]
    write_atomic(extra.add_column(0, "row_key", pa.array(keys, pa.string())), target)


class Carried:
    """The folder's passthrough.parquet, read once: its columns attached to results, a chunk at a time."""

    def __init__(self, extra: pa.Table):
        self.extra = extra.drop_columns(["row_key"])
        self.where = {k: i for i, k in enumerate(extra.column("row_key").to_pylist())}

    def attach(self, table: pa.Table) -> pa.Table:
        """results + the carried columns of each row (by row key; null for a row the file lacks)."""
        take = pa.array([self.where.get(k) for k in table.column("row_key").to_pylist()], pa.int64())
        picked = self.extra.take(take)
        for name in picked.column_names:
            if name not in table.column_names:
                table = table.append_column(picked.schema.field(name), picked.column(name))
        return table


def load(out_dir: Path) -> Optional[Carried]:
    """The folder's carried columns (None: none, or a damaged file, which the caller names and rebuilds)."""
    path = out_dir / FILE
    if not path.exists() or damaged(out_dir):
        return None
    return Carried(pq.read_table(path))
