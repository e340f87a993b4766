"""A running row's checkpoint, and a row admitted from one: long answers continue where they stopped.

A checkpoint is what a row needs to go on exactly as if it had never stopped: its generated
tokens, and the output log-probabilities it recorded (they come from logits no re-prefill
recomputes). Everything else of its sampler follows from the tokens: its random stream is at
draw len(tokens) (RowSampler.skip), the penalties count its tokens, a grammar's matcher and a
reasoning block replay them, the stop-string window and min_tokens read them. A row admitted
with a checkpoint is the scheduler's preempted row: it prefills prompt + kept tokens (taking cached pages where it can)
and samples its next token from the last position's logits, so there is one way to continue a row.
"""
from __future__ import annotations

from typing import Optional

from kvbatch.engine import grammar
from kvbatch.engine.penalties import Tokens
from kvbatch.engine.row import Row
from kvbatch.engine.types import Logprobs, RowCheckpoint


__all__ = ["CheckpointRefused", "RowCheckpoint", "problem", "restore", "take"]


class CheckpointRefused(ValueError):
    """A row cannot continue from the checkpoint it was given (Engine.add): the caller starts it over."""


def take(row: Row) -> RowCheckpoint:
    """The row's checkpoint now (copies: the row goes on)."""
    lp = row.logprobs
    if lp is not None and row.req.sampling.logprobs:
        return RowCheckpoint(list(row.out), list(lp.tokens), [list(t) for t in lp.top])
    return RowCheckpoint(list(row.out))


def problem(row: Row, ck: RowCheckpoint, vocab_size: int, context_length: int) -> Optional[str]:
    """Why the row cannot continue from `ck` (None: it can): the tokens must leave the row running."""
    n, p = len(ck.tokens), row.req.sampling
    if not n:
        return "the checkpoint holds no tokens"
    if any(not 0 <= t < vocab_size for t in ck.tokens):
        return "the checkpoint holds token ids outside the vocabulary"
    if n >= p.max_tokens or row.prompt_len + n >= context_length:
        return f"the checkpoint's {n} tokens leave no room to continue (max_tokens {p.max_tokens})"
    if p.logprobs and (ck.logprobs is None or len(ck.logprobs) != n or len(ck.top) != n):
        return "the checkpoint lacks the logprobs of its tokens"
    return None


def restore(row: Row, ck: RowCheckpoint) -> Optional[str]:
    """Put the checkpoint's state into a fresh row (before it is scheduled); why it cannot continue, else None."""
    s, out = row.sampler, []
    for t in ck.tokens:  # as OutputProcessor.accept took them: the grammar, then the reasoning block
        out.append(t)
        if s.matcher is not None:
            refused = grammar.advance(s.matcher, t)
            if refused:
                return f"the checkpoint's tokens do not match the response_format: {refused}"
        if s.reasoning is not None and s.reasoning.open and s.reasoning.advance(out):
            s.matcher = s.reasoning.matcher
    row.out = Tokens(out)
    row.resumed = len(ck.tokens)
    row.sampler.skip(len(ck.tokens))
    if row.logprobs is not None and ck.logprobs is not None:
        row.logprobs = Logprobs(list(ck.logprobs), [list(t) for t in ck.top], row.logprobs.prompt)
    return None
