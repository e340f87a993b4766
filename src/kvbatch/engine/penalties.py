"""repetition_penalty, presence_penalty and frequency_penalty over a batch, each row its own values.

vLLM's definitions, which are mlx-lm's processors (make_repetition_penalty, make_presence_penalty,
make_frequency_penalty) over the whole history instead of a 20-token window: the repetition penalty
divides a positive logit (multiplies a negative one) of every token in the prompt or the output so
far; the presence penalty is subtracted once from every token in the output so far, the frequency
penalty once per occurrence. Each row keeps its output's token counts up to date (`Counts`: the tokens
added or taken back since the row's last step, not its whole answer, so a step costs the same at token 30,000 as
at token 100), and one scatter per kind builds the (B, V) terms of their distinct tokens on the device.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, SupportsIndex

import mlx.core as mx
import numpy as np

from kvbatch.engine.params import SamplingParams


def used(p: SamplingParams) -> bool:
    """Whether any of the row's repetition, presence or frequency penalties is on."""
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def on_prompt(p: SamplingParams) -> bool:
    """Whether the row's penalties reach its prompt's tokens too (the repetition penalty does)."""
    return p.repetition_penalty != 1


class Tokens(list):
    """A row's output tokens that remember the shortest length they had since `Counts` last read them (`low`):
    tokens are only ever appended or taken off the end, so everything below `low` is what was counted."""

    __slots__ = ("low",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.low = 0  # nothing counted yet

    def _cut(self, at: int) -> None:
        self.low = min(self.low, max(at, 0))

    def __delitem__(self, key: Any) -> None:
        self._cut(key.indices(len(self))[0] if isinstance(key, slice) else key % len(self))
        super().__delitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._cut(key.indices(len(self))[0] if isinstance(key, slice) else key % len(self))
        super().__setitem__(key, value)

    def pop(self, index: SupportsIndex = -1) -> int:
        """list.pop, remembering the cut."""
        self._cut(operator.index(index) % len(self) if len(self) else 0)
        return super().pop(index)

    def insert(self, index: SupportsIndex, value: int) -> None:
        """list.insert, remembering the cut."""
        self._cut(min(operator.index(index) % (len(self) + 1), len(self)))
        super().insert(index, value)

    def remove(self, value: int) -> None:
        """list.remove, remembering the cut."""
        self._cut(self.index(value))
        super().remove(value)

    def clear(self) -> None:
        """list.clear, remembering the cut."""
        self.low = 0
        super().clear()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        """list.sort: everything may have moved."""
        self.low = 0
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        """list.reverse: everything may have moved."""
        self.low = 0
        super().reverse()


class Counts:
    """A row's output token counts (tokens below the vocabulary's size) and its distinct tokens, brought up to
    date from its `Tokens` by what changed since the last read; any other list (a test's) is counted whole."""

    def __init__(self) -> None:
        self.counts = np.zeros(0, dtype=np.int64)
        self.ids: list[int] = []  # the tokens whose count is above 0
        self.seen: list[int] = []  # the tokens counted, in order (what a cut takes back off the counts)
        self.of: Optional[list[int]] = None

    def read(self, out: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct tokens of `out`, (vocab,) int64 counts of its tokens)."""
        if len(self.counts) != vocab or out is not self.of or not isinstance(out, Tokens):
            self.counts, self.ids, self.seen, self.of = np.zeros(vocab, dtype=np.int64), [], [], out
        keep = min(out.low, len(self.seen)) if isinstance(out, Tokens) else 0
        new = out[keep:] if len(out) > keep else []
        if keep < len(self.seen) or len(new) > 64:  # a cut, or many at once: count the changes in one go
            gone = np.asarray(self.seen[keep:], dtype=np.int64)
            np.subtract.at(self.counts, gone[gone < vocab], 1)
            arr = np.asarray(new, dtype=np.int64)
            np.add.at(self.counts, arr[(arr >= 0) & (arr < vocab)], 1)
            self.ids = np.flatnonzero(self.counts).tolist()
        else:
            for t in new:  # a step's few tokens
                if 0 <= t < vocab:
                    if not self.counts[t]:
                        self.ids.append(t)
                    self.counts[t] += 1
        del self.seen[keep:]
        self.seen.extend(new)
        if isinstance(out, Tokens):
            out.low = len(out)
        return np.asarray(self.ids, dtype=np.int64), self.counts


def apply(logits: mx.array,
          rows: list[tuple[int, SamplingParams, Optional[np.ndarray], tuple[np.ndarray, np.ndarray]]]) -> mx.array:
    """logits (B, V) with each (index, params, the prompt's distinct ids, (the output's distinct tokens, its
    token counts by id): Counts.read) row penalized."""
    B, V = logits.shape
    rep, sub = [], []
    factor = np.ones((B, 1), dtype=np.float32)
    for i, p, prompt_ids, (ids, counts) in rows:
        if p.repetition_penalty != 1:
            prompt = prompt_ids if prompt_ids is not None else np.zeros(0, dtype=np.int64)
            seen = np.union1d(prompt, ids) if len(ids) else prompt
            seen = seen[seen < V]
            rep.append((i, seen, np.ones(len(seen), dtype=np.float32)))
            factor[i] = p.repetition_penalty
        if (p.presence_penalty or p.frequency_penalty) and len(ids):
            sub.append((i, ids, p.presence_penalty + p.frequency_penalty * counts[ids]))
    x = logits
    if rep:
        seen = _scatter((B, V), rep) > 0
        f = mx.array(factor)
        x = mx.where(seen, mx.where(x < 0, x * f, x / f), x)
    if sub:
        x = x - _scatter((B, V), sub)
    return x


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
