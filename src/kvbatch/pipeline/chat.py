"""Chat messages: reading them from a row (OpenAI content parts too), the turns a row's template renders
(job.system_prompt before a prompt), and the transcript written to results' `messages` column.

The transcript is the rendered turns plus the assistant's: the results are an SFT dataset as they stand.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from kvbatch.pipeline.config import JobConfig

def _content(i: int, content: Any) -> str:
    """A message's content: a string, or OpenAI content parts ([{"type": "text", "text": ...}]) joined by
    newlines (as vLLM joins them). A part of another type (an image) cannot be sent to a text model."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content holds a {kind or type(part).__name__!r} part; "
                                 f"only text parts ({{type: text, text: ...}}) are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("messages must be a non-empty list of {role, content} with string content "
                     "(or a list of text parts)")


def read_messages(v: Any) -> list[dict]:
    """A row's messages as [{role, content}] with string content; ValueError (-> invalid_input) otherwise."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise ValueError("messages is a string but not JSON") from None
    if hasattr(v, "tolist") and not isinstance(v, list):  # a numpy array (pandas, Parquet lists)
        v = v.tolist()
    if not (isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)):
        raise ValueError("messages must be a non-empty list of {role, content} string pairs")
    out = [{"role": m["role"], "content": _content(i, m.get("content"))} for i, m in enumerate(v)]
    if not any(m["content"].strip() for m in out):
        raise ValueError("messages have no content")
    return out


def turns(payload: dict, job: JobConfig) -> Optional[list[dict]]:
    """The turns the chat template renders for a valid payload; None when the prompt goes as raw text."""
    msgs = payload.get("messages")
    if msgs is not None:
        return msgs
    if not job.chat_template:
        return None
    system = [{"role": "system", "content": job.system_prompt}] if job.system_prompt is not None else []
    return [*system, {"role": "user", "content": payload["prompt"]}]


def continues(msgs: list[dict], job: JobConfig) -> bool:
    """job.continue_final_message and the row ends with an assistant turn: that turn is continued."""
    return job.continue_final_message and msgs[-1]["role"] == "assistant"


def transcript(payload: dict, job: JobConfig, output: str) -> Optional[list[dict]]:
    """The row's turns plus the assistant's (a continued turn holds its start and the output)."""
    msgs = turns(payload, job)
    if msgs is None:
        return None
    if continues(msgs, job):
        return [*msgs[:-1], {"role": "assistant", "content": msgs[-1]["content"] + output}]
    return [*msgs, {"role": "assistant", "content": output}]
