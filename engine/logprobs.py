"""Log-probabilities of the model's own distribution (the raw float32 logits, before temperature,
penalties, filters and grammar masks: vLLM's default), computed with the step's other device work.

Decode: each asking row's chosen token and its top K alternatives, from the logits the step already
has. Prefill (`prompt_logprobs`): every prompt token after the first, from the hidden states of the
prefill pass that stores it, projected to the vocabulary a piece at a time (no extra forward pass,
and never a (prompt, vocab) array at once).
"""
from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

PIECE = 128  # prompt positions projected to the vocabulary at a time


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def chosen_and_top(logits: mx.array, tokens: mx.array, rows: list[int], batch: int, forced: list[Optional[int]],
                   k: int) -> tuple[mx.array, mx.array, mx.array]:
    """For the step's rows `rows` (indices into its batch of `batch`): the log-probability of the token
    each outputs (a teacher-forced one where given, else `tokens`), and the top k (ids, logprobs), best
    first (lazy)."""
    sel = None if len(rows) == batch else mx.array(rows)
    L = _log_softmax(logits if sel is None else logits[sel])
    chosen = tokens if sel is None else tokens[sel]
    if any(f is not None for f in forced):
        use = np.array([f is not None for f in forced])
        fed = np.array([f or 0 for f in forced], dtype=np.int64)
        chosen = mx.where(mx.array(use), mx.array(fed).astype(chosen.dtype), chosen)
    lp = mx.take_along_axis(L, chosen[:, None].astype(mx.int32), axis=-1)[:, 0]
    idx = mx.argpartition(-L, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(L, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return lp, mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def prompt_tokens(hidden: mx.array, head: Callable[[mx.array], mx.array], targets: list[int]) -> mx.array:
    """(m,) log-probabilities of `targets` (the m tokens after positions 0..m-1) from a row's (m, D)
    hidden states (lazy)."""
    t = mx.array(targets, dtype=mx.int32)
    out = []
    for a in range(0, len(targets), PIECE):
        L = _log_softmax(head(hidden[None, a:a + PIECE])[0].astype(mx.float32))
        out.append(mx.take_along_axis(L, t[a:a + PIECE, None], axis=-1)[:, 0])
    return out[0] if len(out) == 1 else mx.concatenate(out)
