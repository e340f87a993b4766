"""The result record: one row of a part and of results.parquet, and the Arrow schema derived from it.

The dataclass is the one definition: its field order is the column order and each
field's `arrow` metadata its column type, so the worker (which builds records), the
parts (which verify a file's schema) and finalize cannot drift apart. The columns of the
per-row parameters (the values each row ran with) come from engine/params.py's table, after `kv_mode`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import pyarrow as pa

from kvbatch.engine.params import PARAMS


MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
TOP = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])


def _col(arrow: pa.DataType, default: Any = None) -> Any:
    return field(default=default, metadata={"arrow": arrow})


# a row parameter's column type (engine/params.py names them) -> its Arrow type
ARROW = {"int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
         "string": pa.string(), "ids": pa.list_(pa.int32())}


def _with_params(cls: type) -> type:
    """The class with a field per row parameter that has a results column (null by default), inserted
    after `kv_mode`, before the dataclass is made of it."""
    annotations: dict[str, Any] = {}
    for name, annotation in cls.__annotations__.items():
        annotations[name] = annotation
        if name == "kv_mode":
            for p in PARAMS:
                if p.column is not None:
                    annotations[p.name] = "Optional[Any]"
                    setattr(cls, p.name, _col(ARROW[p.column]))
    cls.__annotations__ = annotations
    return cls


@dataclass
@_with_params
class ResultRecord:
    """One row of a part and of results.parquet; its fields define the Arrow schema (SCHEMA)."""

    row_key: str = _col(pa.string())
    row_index: int = _col(pa.int64())  # the row's position in the input
    sample_index: int = _col(pa.int32(), 0)  # which of the row's n samples (0 when n = 1); score: which column
    score_column: Optional[str] = _col(pa.string())  # action=score: the input column scored (output holds its text)
    job: Optional[str] = _col(pa.string())
    run_id: Optional[str] = _col(pa.string())
    prompt: Optional[str] = _col(pa.string())
    output: Optional[str] = _col(pa.string())
    # job.reasoning (engine/reasoning.py): the reasoning block's text and the answer after it (output holds
    # both); null without reasoning tags, reasoning null too when the row started after a closed block
    reasoning: Optional[str] = _col(pa.string())
    answer: Optional[str] = _col(pa.string())
    output_token_ids: list[int] = field(default_factory=list, metadata={"arrow": pa.list_(pa.int32())})
    prompt_tokens: Optional[int] = _col(pa.int32())
    cached_tokens: Optional[int] = _col(pa.int32())  # prompt tokens taken from cached or shared pages
    output_tokens: int = _col(pa.int32(), 0)
    finish_reason: str = _col(pa.string(), "error")  # stop | length | error
    stop_reason: Optional[str] = _col(pa.string())  # the stop string, or the stop token's id; null: EOS etc.
    error_code: Optional[str] = _col(pa.string())  # None: the row succeeded
    error_message: Optional[str] = _col(pa.string())
    # the rendered turns plus the assistant's (an SFT dataset as it stands); null: an error, or no chat template
    messages: Optional[list] = _col(MESSAGES)
    model: Optional[str] = _col(pa.string())
    kv_mode: Optional[str] = _col(pa.string())
    # here: a column per row parameter (_with_params)
    # logprobs (sampling.logprobs > 0): per output token its log-probability and the top alternatives, best
    # first; their sum. prompt_logprobs: per prompt token after the first. Null when not asked.
    output_logprobs: Optional[list[float]] = _col(pa.list_(pa.float32()))
    top_logprobs: Optional[list] = _col(pa.list_(pa.list_(TOP)))
    cumulative_logprob: Optional[float] = _col(pa.float64())
    prompt_logprobs: Optional[list[float]] = _col(pa.list_(pa.float32()))
    # action=score: the completion's log-probability per token (cumulative_logprob / output_tokens) and
    # perplexity (exp of minus that); null for generated rows
    mean_logprob: Optional[float] = _col(pa.float64())
    perplexity: Optional[float] = _col(pa.float64())
    ttft_s: Optional[float] = _col(pa.float64())  # from the row's admission to its first token
    queue_s: Optional[float] = _col(pa.float64())  # from submission to admission (waiting for a slot or memory)
    preemptions: int = _col(pa.int32(), 0)  # times its pages were freed to make room (it resumed each time)
    spec_proposed: int = _col(pa.int32(), 0)  # speculative decoding: tokens proposed for the row
    spec_accepted: int = _col(pa.int32(), 0)  # ... and of those, accepted by the model's verification
    resumed_tokens: int = _col(pa.int32(), 0)  # output tokens carried over from a checkpoint (made by an earlier run)
    checkpoints: int = _col(pa.int32(), 0)  # times a worker checkpointed the row while it ran (pipeline/checkpoints.py)
    decode_tps: Optional[float] = _col(pa.float64())
    wall_s: Optional[float] = _col(pa.float64())
    peak_kv_bytes: Optional[int] = _col(pa.int64())
    route: Optional[str] = _col(pa.string())
    attempt: Optional[int] = _col(pa.int32())
    worker: Optional[str] = _col(pa.string())


SCHEMA = pa.schema([(f.name, f.metadata["arrow"]) for f in fields(ResultRecord)])
COLUMNS = SCHEMA.names


_INT_BOUNDS = {pa.int32(): (-(2**31), 2**31 - 1), pa.int64(): (-(2**63), 2**63 - 1)}


_NAMES = tuple(f.name for f in fields(ResultRecord))


def _values(record: ResultRecord) -> dict[str, Any]:
    """The record's fields by name, not copied (dataclasses.asdict deep-copies every token list: a
    measurable share of a results part's time; its values are plain lists, dicts and scalars already)."""
    return {name: getattr(record, name) for name in _NAMES}


def fit(record: ResultRecord) -> ResultRecord:
    """The record made writable whatever it holds: a number outside its column's type is dropped
    (the row then carries invalid_input saying which), text that is not valid UTF-8 is escaped.
    The input reader refuses such values already; this keeps one bad value (from an older queue,
    say) from failing the whole part and every row in it, on every run."""
    d = _values(record)
    bad = []
    for f in fields(ResultRecord):
        v, t = d[f.name], f.metadata["arrow"]
        if t in _INT_BOUNDS and isinstance(v, int) and not _INT_BOUNDS[t][0] <= v <= _INT_BOUNDS[t][1]:
            bad.append(f"{f.name}={v}")
            d[f.name] = None
        elif isinstance(v, str):
            d[f.name] = v.encode("utf-8", "backslashreplace").decode("utf-8")
    out = ResultRecord(**d)
    if bad and not out.error_code:
        out.error_code, out.finish_reason = "invalid_input", "error"
        out.error_message = f"{', '.join(bad)} does not fit the results schema"
    return out


def warm_conversion() -> threading.Thread:
    """pyarrow imports pandas on its first Python -> Arrow conversion (about a second): do that now, on a
    thread beside the model load, rather than at the first results part, between two decode steps."""
    def convert() -> None:
        try:
            pa.array([0])
        except Exception:  # noqa: BLE001 - only a head start: the first part converts again
            pass

    t = threading.Thread(target=convert, name="kvbatch-warm-arrow", daemon=True)
    t.start()
    return t


def to_table(records: list[ResultRecord], metadata: Optional[dict[str, str]] = None) -> pa.Table:
    """An Arrow table of these records in the results schema, with `metadata` on the schema."""
    table = pa.Table.from_pylist([_values(r) for r in records], schema=SCHEMA)
    if metadata:
        table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
    return table
