"""Two common dataset shapes mapped to kvbatch's columns (job.shape): ShareGPT and Alpaca.

sharegpt: `conversations` (job.sharegpt_column), a list of {from, value} turns: human/user -> user,
gpt/assistant -> assistant, system -> system ({role, content} turns are taken as they are). A
conversation ending with an assistant turn is the answer being regenerated: that turn is dropped,
unless job.continue_final_message asks to continue it.
alpaca: `instruction` (job.alpaca_instruction) and an optional `input` (job.alpaca_input), sent as one
user turn: the instruction, a blank line, the input.
A mapping that names a column the file lacks stops the run at start (check); a row whose fields
do not fit the shape is invalid_input.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from kvbatch.pipeline.config import ConfigError, JobConfig

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system"}
DEFAULT_INPUT = JobConfig.alpaca_input


def used(job: JobConfig) -> tuple[str, ...]:
    """The columns the shape reads (not carried through to results.parquet)."""
    if job.shape == "sharegpt":
        return (job.sharegpt_column,)
    if job.shape == "alpaca":
        return (job.alpaca_instruction, job.alpaca_input) if job.alpaca_input else (job.alpaca_instruction,)
    return ()


def check(job: JobConfig, columns: set, name: str) -> None:
    """The shape's columns are in the file (the optional Alpaca input only when named other than 'input')."""
    need = [("job.sharegpt_column", job.sharegpt_column)] if job.shape == "sharegpt" else \
        [("job.alpaca_instruction", job.alpaca_instruction)] + \
        ([("job.alpaca_input", job.alpaca_input)] if job.alpaca_input not in (None, DEFAULT_INPUT) else [])
    for key, col in need:
        if col not in columns:
            raise ConfigError(f"{key}={col!r}: no such column in {name} (job.shape={job.shape}); "
                              f"columns: {sorted(columns, key=str)}")


def _turn(i: int, t: Any) -> dict:
    if not isinstance(t, dict):
        raise ValueError(f"conversations[{i}] is not a {{from, value}} object")
    who, text = (t.get("from"), t.get("value")) if "from" in t else (t.get("role"), t.get("content"))
    if who not in ROLES:
        raise ValueError(f"conversations[{i}].from={who!r}: choose among {', '.join(ROLES)}")
    if not isinstance(text, str):
        raise ValueError(f"conversations[{i}].value must be a string")
    return {"role": ROLES[who], "content": text}


def _sharegpt(conv: Any, job: JobConfig) -> list[dict]:
    if isinstance(conv, str):
        try:
            conv = json.loads(conv)
        except json.JSONDecodeError:
            raise ValueError(f"{job.sharegpt_column} is a string but not JSON") from None
    if hasattr(conv, "tolist") and not isinstance(conv, list):
        conv = conv.tolist()
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{job.sharegpt_column} must be a non-empty list of {{from, value}} turns")
    msgs = [_turn(i, t) for i, t in enumerate(conv)]
    if msgs[-1]["role"] == "assistant" and not job.continue_final_message:
        msgs = msgs[:-1]  # the answer being regenerated
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError(f"{job.sharegpt_column} has no human turn before the answer")
    return msgs


def _alpaca(row: dict, job: JobConfig) -> str:
    instruction = row.get(job.alpaca_instruction)
    extra: Optional[Any] = row.get(job.alpaca_input) if job.alpaca_input else None
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"{job.alpaca_instruction} must be a non-empty string")
    if extra is not None and not isinstance(extra, str):
        raise ValueError(f"{job.alpaca_input} must be a string")
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


def to_row(row: dict, job: JobConfig) -> dict:
    """The row with the shape's fields as kvbatch's prompt or messages column; {"__error__": why} when
    they do not fit (the row's id kept)."""
    try:
        if job.shape == "sharegpt":
            return {**row, job.prompt_column: None, job.messages_column: _sharegpt(row.get(job.sharegpt_column), job)}
        return {**row, job.messages_column: None, job.prompt_column: _alpaca(row, job)}
    except ValueError as exc:
        rid = row.get(job.id_column)
        return {"__error__": str(exc), **({job.id_column: rid} if isinstance(rid, str) else {})}
