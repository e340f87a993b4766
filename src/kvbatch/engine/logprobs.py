"""Log-probabilities of the model's own distribution (the raw float32 logits, before the sampler's
penalties, filters, grammar masks and scaling: vLLM's default), computed with the step's other device work.

Decode: each asking row's chosen token and its top K alternatives, from the logits the step already
has. Prefill (`prompt_logprobs`): every prompt token after the first, from the hidden states of the
prefill pass that stores it, projected to the vocabulary a piece at a time (no extra forward pass,
and never a (prompt, vocab) array at once).
"""
from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from kvbatch.engine.backend import on_cpu

PIECE = 128  # prompt positions projected to the vocabulary at a time


BLOCK = 128  # top-k: vocabulary blocks whose maxima are ranked first


def logsumexp(x: mx.array) -> mx.array:
    """(B, 1) log-sum-exp of (B, V) logits. On the CPU backend MLX's exp is a scalar loop (16 ms for
    32 x 49152 here) and numpy's a vectorized one (0.7 ms): numpy reads the logits in place there
    (which evaluates them: the CPU runs the step in order anyway). MLX elsewhere."""
    if not on_cpu():
        return mx.logsumexp(x, axis=-1, keepdims=True)
    a = np.asarray(x)
    with np.errstate(invalid="ignore", over="ignore"):
        m = a.max(axis=-1, keepdims=True)
        return mx.array(m + np.log(np.exp(a - m).sum(axis=-1, keepdims=True)))


def best_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(ids, values) of each row's k largest entries, best first. A large vocabulary is ranked in two
    stages: the k blocks with the largest maxima hold every one of the k largest values (a block
    holding one of them has a maximum at least the k-th largest), so only k x BLOCK candidates are
    partitioned (1.3 ms instead of 16 for 32 x 49152 on the CPU)."""
    B, V = x.shape
    nblocks = -(-V // BLOCK)
    if nblocks < 4 * k:
        idx = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(x, idx, axis=-1)
    else:
        padded = x if V % BLOCK == 0 else mx.pad(x, [(0, 0), (0, nblocks * BLOCK - V)], constant_values=-mx.inf)
        blocks = padded.reshape(B, nblocks, BLOCK)
        best = mx.argpartition(-blocks.max(axis=-1), kth=k - 1, axis=-1)[:, :k]  # (B, k) block ids
        cand = mx.take_along_axis(blocks, best[:, :, None], axis=1).reshape(B, k * BLOCK)
        ids = (best[:, :, None] * BLOCK + mx.arange(BLOCK, dtype=best.dtype)).reshape(B, k * BLOCK)
        j = mx.argpartition(-cand, kth=k - 1, axis=-1)[:, :k]
        vals, idx = mx.take_along_axis(cand, j, axis=-1), mx.take_along_axis(ids, j, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def chosen_and_top(logits: mx.array, tokens: mx.array, rows: list[int], batch: int, forced: list[Optional[int]],
                   k: int) -> tuple[mx.array, mx.array, mx.array]:
    """For the step's rows `rows` (indices into its batch of `batch`): the log-probability of the token
    each outputs (a teacher-forced one where given, else `tokens`), and the top k (ids, logprobs), best
    first (lazy)."""
    sel = None if len(rows) == batch else mx.array(rows)
    x = logits if sel is None else logits[sel]
    lse = logsumexp(x)
    chosen = tokens if sel is None else tokens[sel]
    if any(f is not None for f in forced):
        use = np.array([f is not None for f in forced])
        fed = np.array([f or 0 for f in forced], dtype=np.int64)
        chosen = mx.where(mx.array(use), mx.array(fed).astype(chosen.dtype), chosen)
    lp = mx.take_along_axis(x, chosen[:, None].astype(mx.int32), axis=-1) - lse
    ids, vals = best_k(x, k)  # ranked on the logits: the same order as the log-probabilities
    return lp[:, 0], ids, vals - lse


def prompt_tokens(hidden: mx.array, head: Callable[[mx.array], mx.array], targets: list[int]) -> mx.array:
    """(m,) log-probabilities of `targets` (the m tokens after positions 0..m-1) from a row's (m, D)
    hidden states (lazy)."""
    t = mx.array(targets, dtype=mx.int32)
    out = []
    for a in range(0, len(targets), PIECE):
        lg = head(hidden[None, a:a + PIECE])[0].astype(mx.float32)
        out.append((mx.take_along_axis(lg, t[a:a + PIECE, None], axis=-1) - logsumexp(lg))[:, 0])
    return out[0] if len(out) == 1 else mx.concatenate(out)
