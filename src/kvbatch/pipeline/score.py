"""action=score: the log-probability of given completions after each row's prompt, on the engine's scorer
(engine/scoring.py, the one the sweep report's teacher-forced columns use).

Queue rows: one per (input row, column of `job.score_columns`), as samples are (pipeline/samples.py):
key `KEY` for a single column, `KEY#COLUMN` for several; position input position x SAMPLE_SLOTS + the
column's index (results.parquet: `row_index`, `sample_index`, `score_column`). Each is claimed, written
and acknowledged on its own, so a score job resumes as a generation job does.

Tokens: the completion's tokens are those of the joint text (the prompt as the row renders it for
generation, chat template and all, followed by the completion) after the prompt's own tokens, as
lm-evaluation-harness splits a context and its continuation; the scored sequence is the joint text's
tokens. Where a token spans the boundary (a completion that starts mid-word: "Say hel" + "lo"), the joint
text's tokens part from the prompt's before its end: that token and the rest are the completion's, and
the prompt's tokens it replaced are not scored. Otherwise the prompt's tokens are what generation would
prefill, so the completions of one prompt share its cached pages.
"""
from __future__ import annotations

from typing import Any

from kvbatch.pipeline.config import JobConfig
from kvbatch.pipeline.inputs import BAD, TEXTS, InputRow
from kvbatch.pipeline.prompts import render
from kvbatch.pipeline.samples import SAMPLE_SLOTS


def expand(rows: list[InputRow], columns: list[str]) -> list[InputRow]:
    """The queue rows of these input rows: one per column to score (an unusable row: each its error)."""
    taken = {r.key for r in rows}
    out: list[InputRow] = []
    for r in rows:
        base = {k: v for k, v in r.payload.items() if k not in (TEXTS, BAD)}
        for i, col in enumerate(columns):
            key = r.key
            if len(columns) > 1:
                key = f"{r.key}#{col}"
                while key in taken:
                    key += "#"
                taken.add(key)
            payload = {**base, "score_column": col, "sample_index": i}
            if "error" not in payload:
                why = r.payload.get(BAD, {}).get(col)
                if why is not None:
                    payload["error"] = why
                else:
                    payload["completion"] = r.payload[TEXTS][col]
            out.append(InputRow(r.pos * SAMPLE_SLOTS + i, key, payload))
    return out


def tokens(tokenizer: Any, payload: dict, job: JobConfig) -> tuple[list[int], list[int]]:
    """(the prompt's tokens, the completion's tokens) of a valid queue row (module docstring); ValueError
    (-> invalid_input) when either is empty or the prompt cannot be rendered."""
    prompt = render(tokenizer, payload, job)
    text = render(tokenizer, payload, job, tokenize=False)
    joint = text + payload["completion"]
    chat = "messages" in payload or job.chat_template  # a rendered template carries its own special tokens
    whole = [int(t) for t in (tokenizer.encode(joint, add_special_tokens=False) if chat else tokenizer.encode(joint))]
    k = 0  # the prompt's tokens the joint text starts with (all of them unless a token spans the boundary)
    while k < min(len(prompt), len(whole)) and prompt[k] == whole[k]:
        k += 1
    if not k:
        raise ValueError("the prompt has no tokens before the completion's: its first token has nothing to follow")
    if k == len(whole):
        raise ValueError(f"{payload['score_column']} has no tokens after the prompt's: nothing to score")
    return prompt[:k], whole[k:]
