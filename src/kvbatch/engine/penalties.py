"""repetition_penalty, presence_penalty and frequency_penalty over a batch, each row its own values.

vLLM's definitions, which are mlx-lm's processors (make_repetition_penalty, make_presence_penalty,
make_frequency_penalty) over the whole history instead of a 20-token window: the repetition penalty
divides a positive logit (multiplies a negative one) of every token in the prompt or the output so
far; the presence penalty is subtracted once from every token in the output so far, the frequency
penalty once per occurrence. Each row keeps its output's token counts up to date (`Counts`: from the tokens
added or taken back since the row's last step, not from its whole answer), and one scatter per kind builds the
(B, V) terms of the rows' distinct tokens on the device.
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
        self._cut(key.indices(len(self))[0] if isinstance(key, slice) else key % max(len(self), 1))
        super().__delitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._cut(key.indices(len(self))[0] if isinstance(key, slice) else key % max(len(self), 1))
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
    """A row's distinct output tokens (below the vocabulary's size) and how often each was output, brought up to
    date from its `Tokens` by what changed since the last read (any other list is counted whole). Memory is
    O(distinct tokens): a token's place in two growing arrays, found through a dict."""

    def __init__(self) -> None:
        self.of: Optional[list[int]] = None
        self.vocab = 0
        self._reset()

    def _reset(self) -> None:
        self.place: dict[int, int] = {}  # token -> its index in ids / counts
        self.ids = np.zeros(64, dtype=np.int64)
        self.counts = np.zeros(64, dtype=np.int64)
        self.n = 0  # distinct tokens held
        self.seen: list[int] = []  # the tokens counted, in order (what a cut takes back)

    def read(self, out: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct tokens of `out`, how often each was output), aligned."""
        if vocab != self.vocab or out is not self.of or not isinstance(out, Tokens):
            self._reset()
            self.of, self.vocab = out, vocab
        keep = min(out.low, len(self.seen)) if isinstance(out, Tokens) else 0
        for t in self.seen[keep:]:
            self._take(t)
        new = out[keep:]
        for t in new:
            self._add(t)
        del self.seen[keep:]
        self.seen.extend(new)
        if isinstance(out, Tokens):
            out.low = len(out)
        return self.ids[:self.n], self.counts[:self.n]

    def _add(self, t: int) -> None:
        if not 0 <= t < self.vocab:
            return
        i = self.place.get(t)
        if i is not None:
            self.counts[i] += 1
            return
        if self.n == len(self.ids):
            self.ids, self.counts = np.resize(self.ids, 2 * self.n), np.resize(self.counts, 2 * self.n)
        self.place[t] = self.n
        self.ids[self.n], self.counts[self.n] = t, 1
        self.n += 1

    def _take(self, t: int) -> None:
        i = self.place.get(t)
        if i is None:  # never counted (outside the vocabulary)
            return
        self.counts[i] -= 1
        if self.counts[i]:
            return
        last = self.n - 1  # the last distinct token takes its place
        moved = int(self.ids[last])
        self.ids[i], self.counts[i] = moved, self.counts[last]
        self.place[moved] = i
        del self.place[t]
        self.n = last


def apply(logits: mx.array,
          rows: list[tuple[int, SamplingParams, Optional[np.ndarray], tuple[np.ndarray, np.ndarray]]]) -> mx.array:
    """logits (B, V) with each (index, params, the prompt's distinct ids, (the output's distinct tokens, how often
    each was output): Counts.read) row penalized."""
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
            sub.append((i, ids, p.presence_penalty + p.frequency_penalty * counts))
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
