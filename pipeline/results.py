"""The result record: one row of a part and of results.parquet, and the Arrow schema derived from it.

The dataclass is the one definition: its field order is the column order and each
field's `arrow` metadata its column type, so the worker (which builds records), the
parts (which verify a file's schema) and finalize cannot drift apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import pyarrow as pa


def _col(arrow: pa.DataType, default=None):
    return field(default=default, metadata={"arrow": arrow})


@dataclass
class ResultRecord:
    row_key: str = _col(pa.string())
    row_index: int = _col(pa.int64())  # the row's position in the input
    job: Optional[str] = _col(pa.string())
    run_id: Optional[str] = _col(pa.string())
    prompt: Optional[str] = _col(pa.string())
    output: Optional[str] = _col(pa.string())
    output_token_ids: list[int] = field(default_factory=list, metadata={"arrow": pa.list_(pa.int32())})
    prompt_tokens: Optional[int] = _col(pa.int32())
    output_tokens: int = _col(pa.int32(), 0)
    finish_reason: str = _col(pa.string(), "error")  # stop | length | error
    error_code: Optional[str] = _col(pa.string())  # None: the row succeeded
    error_message: Optional[str] = _col(pa.string())
    model: Optional[str] = _col(pa.string())
    kv_mode: Optional[str] = _col(pa.string())
    max_tokens: Optional[int] = _col(pa.int32())
    temperature: Optional[float] = _col(pa.float64())
    top_p: Optional[float] = _col(pa.float64())
    top_k: Optional[int] = _col(pa.int32())
    seed: Optional[int] = _col(pa.int64())
    ttft_s: Optional[float] = _col(pa.float64())
    decode_tps: Optional[float] = _col(pa.float64())
    wall_s: Optional[float] = _col(pa.float64())
    peak_kv_bytes: Optional[int] = _col(pa.int64())
    route: Optional[str] = _col(pa.string())
    attempt: Optional[int] = _col(pa.int32())
    worker: Optional[str] = _col(pa.string())


SCHEMA = pa.schema([(f.name, f.metadata["arrow"]) for f in fields(ResultRecord)])
COLUMNS = SCHEMA.names


def to_table(records: list[ResultRecord], metadata: Optional[dict[str, str]] = None) -> pa.Table:
    table = pa.Table.from_pylist([asdict(r) for r in records], schema=SCHEMA)
    if metadata:
        table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
    return table
