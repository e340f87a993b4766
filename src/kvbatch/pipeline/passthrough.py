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
            cols[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # mixed types: as JSON text
            cols[name] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=str)
                                   for v in values], pa.string())
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
        return table.select(keep) if table.num_rows == n_rows else pa.table({})
    if fmt == "csv":
        _, rows = inputs._csv(path)
        records: list[Optional[dict]] = list(rows)
    else:
        records = [None if "__error__" in obj else obj for obj, _ in inputs._jsonl(path)]
    return _from_records(records, used) if len(records) == n_rows else pa.table({})


def write(out_dir: Path, path: Path, fmt: str, job: JobConfig, keys_by_pos: list[list[str]]) -> None:
    """passthrough.parquet for this input (removed when it has no carried columns): keys_by_pos holds
    the row keys of each input position (several: its samples, which all carry its columns)."""
    target = out_dir / FILE
    extra = extra_columns(path, fmt, job, len(keys_by_pos))
    if not extra.num_columns:
        target.unlink(missing_ok=True)
        return
    extra = extra.rename_columns([carried_name(c) for c in extra.column_names]).replace_schema_metadata(None)
    if any(len(keys) != 1 for keys in keys_by_pos):
        extra = extra.take(pa.array([pos for pos, keys in enumerate(keys_by_pos) for _ in keys], pa.int64()))
    keys = [k for ks in keys_by_pos for k in ks]
    write_atomic(extra.add_column(0, "row_key", pa.array(keys, pa.string())), target)


def attach(table: pa.Table, out_dir: Path) -> pa.Table:
    """results + the carried columns of each row (by row key; null for a row the file lacks)."""
    path = out_dir / FILE
    if not path.exists():
        return table
    extra = pq.read_table(path)
    where = {k: i for i, k in enumerate(extra.column("row_key").to_pylist())}
    take = pa.array([where.get(k) for k in table.column("row_key").to_pylist()], pa.int64())
    picked = extra.drop_columns(["row_key"]).take(take)
    for name in picked.column_names:
        if name not in table.column_names:
            table = table.append_column(picked.schema.field(name), picked.column(name))
    return table
