"""repetition_penalty, presence_penalty and frequency_penalty over a batch, each row its own values.

vLLM's definitions, which are mlx-lm's processors (make_repetition_penalty, make_presence_penalty,
make_frequency_penalty) over the whole history instead of a 20-token window: the repetition penalty
divides a positive logit (multiplies a negative one) of every token in the prompt or the output so
far; the presence penalty is subtracted once from every token in the output so far, the frequency
penalty once per occurrence. The host lists each row's tokens (distinct ids and counts) and one
scatter per kind builds the (B, V) terms on the device.
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from kvbatch.engine.params import SamplingParams


def used(p: SamplingParams) -> bool:
    """Whether any of the row's repetition, presence or frequency penalties is on."""
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def on_prompt(p: SamplingParams) -> bool:
    """Whether the row's penalties reach its prompt's tokens too (the repetition penalty does)."""
    return p.repetition_penalty != 1


def _scatter(shape: tuple[int, int], entries: list[tuple[int, np.ndarray, np.ndarray]]) -> mx.array:
    """(B, V) float32 zeros plus, for each (row, ids, values), values at ids (ids distinct)."""
    width = max(len(ids) for _, ids, _ in entries)
    rows = np.zeros((len(entries), width), dtype=np.int32)
    cols = np.zeros((len(entries), width), dtype=np.int32)
    vals = np.zeros((len(entries), width), dtype=np.float32)  # padding adds 0 to (row, 0)
    for j, (i, ids, v) in enumerate(entries):
        rows[j] = i
        cols[j, :len(ids)] = ids
        vals[j, :len(ids)] = v
    return mx.zeros(shape, dtype=mx.float32).at[mx.array(rows), mx.array(cols)].add(mx.array(vals))


def apply(logits: mx.array, rows: list[tuple[int, SamplingParams, Optional[np.ndarray], list[int]]]) -> mx.array:
    """logits (B, V) with each (index, params, the prompt's distinct ids, output so far) row penalized."""
    B, V = logits.shape
    rep, sub = [], []
    factor = np.ones((B, 1), dtype=np.float32)
    for i, p, prompt_ids, out in rows:
        ids, counts = np.unique(np.asarray(out, dtype=np.int64), return_counts=True)
        if p.repetition_penalty != 1:
            prompt = prompt_ids if prompt_ids is not None else np.zeros(0, dtype=np.int64)
            seen = np.union1d(prompt, ids) if len(ids) else prompt
            seen = seen[seen < V]
            rep.append((i, seen, np.ones(len(seen), dtype=np.float32)))
            factor[i] = p.repetition_penalty
        if (p.presence_penalty or p.frequency_penalty) and len(ids):
            keep = ids < V
            sub.append((i, ids[keep], p.presence_penalty + p.frequency_penalty * counts[keep]))
    x = logits
    if rep:
        seen = _scatter((B, V), rep) > 0
        f = mx.array(factor)
        x = mx.where(seen, mx.where(x < 0, x * f, x / f), x)
    if sub:
        x = x - _scatter((B, V), sub)
    return x
