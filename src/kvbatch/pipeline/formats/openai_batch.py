"""OpenAI Batch API files: requests in (job.format=openai_batch, detected from a .jsonl's first line), the
batch output JSONL out (output.openai_batch=true), so a pipeline built on the OpenAI Batch API or vLLM's
`run-batch` moves to kvbatch without changes.

A request line (`custom_id`, `method`, `url`, `body`) becomes a row: custom_id the row key, the body's
messages, the body keys that kvbatch's per-row parameters share (engine/params.py marks them: `openai`),
max_completion_tokens as max_tokens, logprobs/top_logprobs as kvbatch's own per-row columns. A body
key kvbatch cannot honour (tools, logit_bias, ...) makes that request invalid_input naming the key:
never accepted and ignored. `model` is not honoured either way: the job's model runs every request.
A body without temperature or max_tokens gets the OpenAI API's defaults (DEFAULTS: temperature 1,
max_tokens up to the model's context), not the job's, so a request means what it means to OpenAI.
A request's n samples are results rows of one row_index (sample_index 0..n-1): one output line, its
choices in sample order; a failed sample makes the line an error (the format has no partial answer).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa

from kvbatch.engine.params import INT32_MAX, PARAMS

FILE = "batch_output.jsonl"
URLS = ("/v1/chat/completions", "/chat/completions")
# body keys with the same name and meaning as kvbatch's per-row columns
SAME = tuple(p.name for p in PARAMS if p.openai)
RENAMED = {"max_completion_tokens": "max_tokens"}  # body keys kvbatch names otherwise
# body keys with no effect on the output (model: the job's model runs every request)
INERT = ("model", "user", "metadata", "store", "service_tier")
# the OpenAI API's values where a request sets none (max_tokens: no limit but the model's context,
# where the engine ends every row)
DEFAULTS = {"temperature": 1.0, "max_tokens": INT32_MAX}
DEFAULTS_NOTE = ("OpenAI batch requests without temperature or max_tokens get the OpenAI API's defaults: "
                 "temperature 1, max_tokens up to the model's context (not the job's sampling.temperature "
                 "and job.max_tokens)")


def sniff(path: Path) -> bool:
    """Whether a JSONL file's first non-blank line is an OpenAI Batch request."""
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as fh:
            for line in fh:
                if line.strip():
                    obj = json.loads(line)
                    return isinstance(obj, dict) and "custom_id" in obj and isinstance(obj.get("body"), dict)
    except (OSError, ValueError, RecursionError):
        return False
    return False


def _row(obj: dict, id_column: str, messages_column: str) -> dict:
    if not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise ValueError("custom_id must be a non-empty string")
    url, body = obj.get("url", URLS[0]), obj.get("body")
    if url not in URLS:
        raise ValueError(f"url {url!r}: only /v1/chat/completions requests are supported")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    row: dict[str, Any] = {id_column: obj["custom_id"], messages_column: body.get("messages")}
    if body.get("messages") is None:
        raise ValueError("body.messages is missing")
    for name, value in body.items():
        if name in ("messages", *INERT) or value is None or (name == "stream" and value is False):
            continue
        if RENAMED.get(name, name) in SAME:  # n: one results row per sample, the choices of one output line
            row[RENAMED.get(name, name)] = value
        elif name not in ("logprobs", "top_logprobs"):
            raise ValueError(f"body.{name} is not supported by kvbatch (it would be ignored)")
    _logprobs_of(body, row)
    for name, value in DEFAULTS.items():
        row.setdefault(name, value)
    return row


def _logprobs_of(body: dict, row: dict) -> None:
    """body.logprobs (true/false) and body.top_logprobs as kvbatch's logprobs: the alternatives kept per
    token, on from 1."""
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise ValueError(f"body.logprobs must be true or false, got {body['logprobs']!r}")
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise ValueError("body.top_logprobs needs body.logprobs=true")
    if body.get("logprobs") is True:
        top = body.get("top_logprobs")
        row["logprobs"] = 1 if top in (None, 0) else top  # a bad top_logprobs is refused as logprobs is


def to_row(obj: dict, id_column: str, messages_column: str) -> dict:
    """One request line -> a row of kvbatch's columns, or {"__error__": why} (then invalid_input)."""
    try:
        return _row(obj, id_column, messages_column)
    except ValueError as exc:
        out = {"__error__": f"OpenAI batch request: {exc}"}
        if isinstance(obj.get("custom_id"), str) and obj["custom_id"]:
            out[id_column] = obj["custom_id"]  # its line still answers under its custom_id
        return out


def _logprobs(row: dict, decode: Callable[[int], str]) -> Optional[dict]:
    if row.get("output_logprobs") is None:
        return None

    def tok(tid: int, lp: float) -> dict:
        text = decode(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    alts = row.get("top_logprobs") or [[] for _ in row["output_logprobs"]]
    return {"content": [{**tok(tid, lp), "top_logprobs": [tok(a["token_id"], a["logprob"]) for a in alt]}
                        for tid, lp, alt in zip(row["output_token_ids"], row["output_logprobs"], alts)],
            "refusal": None}


def _message(row: dict) -> dict:
    """The assistant message: its content, and for a row with reasoning tags the answer as content and the
    reasoning block as reasoning_content (as vLLM's reasoning parsers return them)."""
    if row.get("answer") is None:
        return {"role": "assistant", "content": row["output"], "refusal": None}
    return {"role": "assistant", "content": row["answer"], "reasoning_content": row.get("reasoning"), "refusal": None}


def _custom_id(rows: list[dict]) -> str:
    """The request's id: the row key, or for n samples the key their sample keys were made from."""
    if len(rows) == 1 and not rows[0].get("sample_index"):
        return rows[0]["row_key"]
    return re.sub(r"#s\d+#*$", "", rows[0]["row_key"])


def output_line(rows: list[dict], model: str, created: int, decode: Callable[[int], str]) -> dict:
    """The batch output line of one request (its results rows: one, or its n samples in order): a
    chat.completion, or the first error among them."""
    cid = _custom_id(rows)
    rid = hashlib.sha256(f"{rows[0]['run_id']}\n{cid}".encode()).hexdigest()[:24]
    line: dict[str, Any] = {"id": f"batch_req_{rid}", "custom_id": cid}
    failed = [r for r in rows if r["error_code"] is not None]
    if failed:
        r = failed[0]
        which = f"sample {r.get('sample_index') or 0}: " if len(rows) > 1 else ""
        return {**line, "response": None, "error": {"code": r["error_code"], "message": which + r["error_message"]}}
    prompt = rows[0]["prompt_tokens"] or 0
    completion = sum(r["output_tokens"] or 0 for r in rows)
    choices = [{"index": i, "message": _message(r), "logprobs": _logprobs(r, decode),
                "finish_reason": r["finish_reason"]} for i, r in enumerate(rows)]
    body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return {**line, "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def write_output(path: Path, table: pa.Table, decode: Callable[[int], str]) -> None:
    """The batch output JSONL (one line per request, input order) written atomically."""
    created = int(time.time())
    requests: dict[int, list[dict]] = {}
    for row in table.to_pylist():  # in input order, a row's samples together
        requests.setdefault(row["row_index"], []).append(row)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for rows in requests.values():
            rows.sort(key=lambda r: r.get("sample_index") or 0)
            fh.write(json.dumps(output_line(rows, rows[0]["model"] or "", created, decode), ensure_ascii=False) + "\n")
    tmp.replace(path)
