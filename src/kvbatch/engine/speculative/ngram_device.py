"""N-gram proposals searched on the device (`speculative.ngram_search=device`): the proposals of
ngram.py's NgramIndex (the latest earlier occurrence of the longest suffix of the row's tokens,
prompt_lookup_max down to prompt_lookup_min tokens, and the tokens that followed it), found for every
proposing row of a step at once by a few array operations over the rows' tokens kept on the device.

Why: at ~1,000 rows a verification pass on a GPU waits for the host, and keeping each row's n-gram
index and looking its suffix up is Python per row (~9 µs a row a pass, ~40% of a pass's host work at
1,024 rows on a 2-core CPU: docs/performance.md). Here the host only appends each row's new tokens to
its history (one scatter a step) and reads back up to k tokens a row. The search compares every earlier
position of every row (rows x tokens x prompt_lookup_max), which a GPU does in well under a millisecond
and a CPU core does not: the host index stays the default.

The histories are one (slots, capacity) int32 array. A row takes a slot at its first proposal and gives it
back at `forget` once it no longer runs; the array grows, doubling, in slots and in tokens. A slot's
tokens past its row's length are never read (the search and the proposal stop at the row's length), so a
slot is reused without clearing.
"""
from __future__ import annotations

from typing import cast

import mlx.core as mx

from kvbatch.engine.row import Row


def ngram_search(hist: mx.array, lens: mx.array, n_min: int, n_max: int, k: int) -> tuple[mx.array, mx.array]:
    """For each row r of hist (R, T) int32 holding lens[r] tokens: where the latest earlier occurrence of
    the longest suffix of n_max down to n_min tokens ends (place, -1 for none; NgramIndex.match), and the
    up to k tokens after it (R, k), -1 past the row's tokens or where there is no place."""
    R, T = hist.shape
    pos = mx.arange(T)[None, :]  # p: where a candidate occurrence ends
    last = lens[:, None] - 1
    run = mx.ones((R, T), dtype=mx.bool_)  # tokens p-j..p equal the suffix's last j+1 so far
    length = mx.zeros((R, T), dtype=mx.int32)  # the suffix's tokens matched, ending at p
    for j in range(n_max):
        want = mx.take_along_axis(hist, mx.maximum(last - j, 0), axis=1)  # the suffix's (j+1)-th token from its end
        seen = hist if j == 0 else mx.concatenate([mx.full((R, j), -1, dtype=hist.dtype), hist[:, :T - j]], axis=1)
        run = run & (seen == want) & (pos >= j) & (last >= j)
        length = length + run.astype(mx.int32)
    length = mx.minimum(length, mx.minimum(lens - 1, n_max)[:, None])  # a suffix shorter than the sequence
    found = (pos < last) & (length >= n_min)  # earlier occurrences only: not the suffix itself
    best = mx.max(mx.where(found, length * T + pos, -1), axis=1)  # the longest, then the latest
    place = mx.where(best >= 0, best % T, -1)
    at = place[:, None] + 1 + mx.arange(k)[None, :]
    after = mx.take_along_axis(hist, mx.clip(at, 0, T - 1), axis=1)
    return place, mx.where((place[:, None] >= 0) & (at < lens[:, None]), after, -1)


class DeviceNgramProposer:
    """Proposals from each row's own tokens, as NgramProposer makes them, searched on the device."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.hist = mx.zeros((0, 0), dtype=mx.int32)
        self.rows: dict[int, tuple[Row, int, int]] = {}  # id(row) -> (row, slot, tokens of it in the slot)
        self.free: list[int] = []
        self.slots = 0  # slots handed out so far (the array may hold more)

    def propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens from rows[i]'s earlier tokens after its latest n-gram match."""
        slots, lens = self.sync(rows)
        _, after = ngram_search(mx.take(self.hist[:, :max(lens)], mx.array(slots), axis=0),
                                mx.array(lens, dtype=mx.int32), self.n_min, self.n_max, max(ks))
        mx.eval(after)  # the search is the device's work: evaluated apart from the read, as a profile shows it
        found = cast(list[list[int]], after.tolist())
        return [[t for t in toks[:kk] if t >= 0] for toks, kk in zip(found, ks)]

    def sync(self, rows: list[Row]) -> tuple[list[int], list[int]]:
        """Each row's slot made to hold its tokens so far (prompt and output), in one scatter: the rows'
        slots and token counts."""
        slots, lens, put_slot, put_pos, put_tok = [], [], [], [], []
        for row in rows:
            prompt, out = row.req.prompt_tokens, row.out
            n, P = len(prompt) + len(out), len(prompt)
            held = self.rows.get(id(row))
            # a row's tokens only grow, but for those taken back off its output (engine.py _read_pass): the
            # slot's first n tokens are the row's still
            slot, have = (self._take(), 0) if held is None else (held[1], min(held[2], n))
            if have < n:
                new = (list(prompt[have:]) + list(out)) if have < P else list(out[have - P:])
                put_slot += [slot] * len(new)
                put_pos += range(have, n)
                put_tok += new
            self.rows[id(row)] = (row, slot, n)
            slots.append(slot)
            lens.append(n)
        self._fit(max(lens))
        if put_tok:
            self.hist[mx.array(put_slot), mx.array(put_pos)] = mx.array(put_tok, dtype=mx.int32)
        return slots, lens

    def extend(self, slots: mx.array, lens: mx.array, tokens: mx.array, kept: mx.array, k: int,
               bound: int) -> tuple[mx.array, mx.array]:
        """A chained pass's proposals, on the device: each row's window tokens (B, W) written after its
        `lens` tokens in its slot, `kept` (B,) of them its own (those past them are overwritten later and
        never read), then searched. bound: the most tokens any slot holds after this (its capacity
        grown first). Returns the rows' proposals (B, k), -1 where none, and their new token counts."""
        W = tokens.shape[1]
        self._fit(bound + W)
        at = lens[:, None] + mx.arange(W, dtype=mx.int32)[None, :]
        self.hist[mx.broadcast_to(slots[:, None], at.shape), at] = tokens.astype(mx.int32)
        lens = lens + kept
        _, after = ngram_search(mx.take(self.hist[:, :bound], slots, axis=0), lens, self.n_min, self.n_max, k)
        return after, lens

    def _take(self) -> int:
        """A free slot (one given back, else a new one)."""
        if self.free:
            return self.free.pop()
        self.slots += 1
        return self.slots - 1

    def _fit(self, tokens: int) -> None:
        """Grow the histories (doubling) to hold every slot handed out and `tokens` tokens a slot."""
        rows, width = self.hist.shape
        if rows >= self.slots and width >= tokens:
            return
        shape = (rows if rows >= self.slots else max(self.slots, 2 * rows),
                 width if width >= tokens else max(tokens, 2 * width))
        grown = mx.zeros(shape, dtype=mx.int32)
        if rows and width:
            grown[:rows, :width] = self.hist
        self.hist = grown

    def prepare(self, rows: list[Row], proposals: list[list[int]]) -> None:
        """Nothing ahead: a search costs the host no more than reading its result."""

    def forget(self, everything: bool = False) -> None:
        """Give back the slots of rows no longer running (everything: of every row)."""
        for rid, (row, slot, _) in list(self.rows.items()):
            if everything or row.ended or not row.active:
                self.free.append(slot)
                del self.rows[rid]

    def stats(self) -> dict:
        """Where the rows' suffixes are looked up (summary.json's engine records it)."""
        return {"ngram_search": "device"}

