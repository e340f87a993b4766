"""Per-pass index arrays the routes share: page tables, token slots, causal masks, in-place page
indices, and the q8/q4 tail writes of a decode step."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.store import head_rows


def page_table(rows: list[CacheRow], n_pages: list[int]) -> mx.array:
    """(B, width) int32: each row's first n_pages pages."""
    return mx.array(_padded(rows, n_pages, max(max(n_pages), 1)), dtype=mx.int32)


def page_array(rows: list[CacheRow], n_pages: list[int]) -> np.ndarray:
    """page_table's entries as a host array (B, width) int32, for building a pass's slots with numpy."""
    return np.array(_padded(rows, n_pages, max(max(n_pages), 1)), dtype=np.int32).reshape(len(rows), -1)


def _padded(rows: list[CacheRow], n_pages: list[int], width: int) -> list[list[int]]:
    """Each row's first n pages, padded to `width` with its own first page (masked out): never another
    row's page, whose K/V may be NaN in this very pass (masked slots still meet probs @ V). Built as
    Python lists: per-row numpy slice assignments cost ~0.2 ms a step at batch 32."""
    return [r.pages[:n] + [r.pages[0] if r.pages else 0] * (width - n) for r, n in zip(rows, n_pages)]


class PageTables:
    """Decode steps' page tables, each built from the step before while the same rows run in the same order:
    only the entries that changed are written again. At a large batch some row starts a page at nearly every
    step, and a table built whole from the host's lists costs ~1 ms a step at 1,024 rows.

    A row's first n pages never change while its count stays at n or above: pages are only appended. So a
    row whose count grew needs its new entries written, one whose count dropped its padding. Two things give a
    row other pages: an admission after a preemption (CacheRow.admissions) and a rollback that frees pages a
    verification window had reserved (CacheRow.cuts); both only count up, so their sum moves whenever either
    does, and a row whose sum moved is written again whole."""

    def __init__(self) -> None:
        self._rows: list[CacheRow] = []
        self._marks: list[int] = []
        self._counts: list[int] = []
        self._table: Optional[np.ndarray] = None
        self._device: Optional[mx.array] = None  # `_table` on the device, where `table` made it

    def table(self, rows: list[CacheRow], n_pages: list[int], reuse: bool = True) -> mx.array:
        """page_table(rows, n_pages), the same entries: the last call's device array where it holds them (the
        same rows, marks and counts: see the class docstring) and `reuse`, else the table uploaded."""
        if (reuse and self._device is not None and n_pages == self._counts and len(rows) == len(self._rows)
                and all(map(operator.is_, rows, self._rows)) and [r.admissions + r.cuts for r in rows] == self._marks):
            return self._device
        device = mx.array(self.padded(rows, n_pages))
        self._device = device
        return device

    def padded(self, rows: list[CacheRow], n_pages: list[int]) -> np.ndarray:
        """The same table as an int32 array of the host's (a new one each call). Decode steps and
        verification windows take turns here: a window reaches a page further for some rows, so the
        table narrows and widens by a column between calls and only those rows change."""
        width = max(max(n_pages), 1)
        self._device = None  # made for the table this call replaces
        last, marks, before = self._table, [r.admissions + r.cuts for r in rows], self._counts
        if last is None or len(rows) != len(self._rows) or not all(map(operator.is_, rows, self._rows)):
            table = np.array(_padded(rows, n_pages, width), dtype=np.int32).reshape(len(rows), width)
        else:  # padding columns repeat each row's first entry (its first page, or 0 for a row without pages)
            table = np.concatenate([last[:, :width], np.repeat(last[:, :1], max(width - last.shape[1], 0), axis=1)],
                                   axis=1)
            moved: list[int] = []
            if n_pages != before:  # one list comparison in C; most calls differ in a few rows only
                moved = np.flatnonzero(np.asarray(n_pages) != np.asarray(before)).tolist()
                at, col, page = [], [], []
                for i in moved:
                    r, n, b = rows[i], n_pages[i], before[i]
                    new = range(b, n) if n > b else range(n, min(b, width))  # entries gained, or padding again
                    at += [i] * len(new)
                    col += new
                    page += r.pages[b:n] if n > b else [r.pages[0] if r.pages else 0] * len(new)
                table[at, col] = page
            # written again whole: rows given other pages, and rows with no page in the table before or now (their
            # padding, the first page they hold or 0, may be another)
            whole = [i for i, (m, was) in enumerate(zip(marks, self._marks)) if m != was] if marks != self._marks \
                else []
            whole += [i for i in moved if before[i] == 0]
            whole += [i for i, n in enumerate(n_pages) if n == 0] if 0 in n_pages else []
            for i in whole:
                r, n = rows[i], n_pages[i]
                table[i, :n] = r.pages[:n]
                table[i, n:] = r.pages[0] if r.pages else 0
        self._rows, self._marks, self._counts, self._table = list(rows), marks, list(n_pages), table
        return table


def window_last(starts: list[int], lens: list[int], L: int) -> list[list[int]]:
    """A few-token pass (lens[b] tokens of row b from position starts[b], right-padded to L): the position
    of the last key each query j sees, starts[b] + j; a padding position sees the row's real tokens."""
    return [[a + min(j, n - 1) for j in range(L)] for a, n in zip(starts, lens)]


def pass_slots(rows: list[CacheRow], P: int, pos: list[int], lens: list[int],
               tables: Optional[PageTables]) -> tuple[np.ndarray, mx.array]:
    """A multi-token pass (row b writes lens[b] tokens from pos[b]): the pool slots (page * P + offset) of
    its tokens, row after row, and its page table (page_table's, each row's pages up to its last
    token; from `tables` where given: a verification window's rows are the decode step's, so only the
    rows whose page count moved are written again, where a whole build costs ~4 ms a pass at 1,024 rows
    of 100 pages). The slots from that one table for all rows: a window is a few tokens a row, where
    numpy calls per row cost more than the tokens."""
    n_pages = [-(-(a + n) // P) for a, n in zip(pos, lens)]
    if tables is not None:
        padded = tables.padded(rows, n_pages)
    else:
        padded = page_array(rows, n_pages)
    which = np.repeat(np.arange(len(rows)), lens)
    starts = np.cumsum(lens) - np.asarray(lens)  # each row's first token in the pass's list
    t = np.arange(len(which)) - starts[which] + np.asarray(pos, dtype=np.int64)[which]
    return padded[which, t // P].astype(np.int64) * P + t % P, mx.array(padded)


def window_rows(table: mx.array, pos: mx.array, L: int, P: int, H: int) -> mx.array:
    """A window of L tokens a row at device positions pos (B,) int32 (a chained verification pass, whose
    positions the device computed and the host never read): the head rows (kv.store.head_rows) of its
    tokens, row after row, found through the page table on the device."""
    t = pos[:, None] + mx.arange(L, dtype=mx.int32)[None, :]  # (B, L) each token's position
    page = mx.take_along_axis(table, t // P, axis=1)
    rows = ((page * H)[..., None] + mx.arange(H, dtype=mx.int32)) * P + (t % P)[..., None]  # (B, L, H)
    return rows.reshape(-1).astype(mx.int32)


def causal_mask(pos: np.ndarray | mx.array, L: int, T: int, extra_dims: int) -> mx.array:
    """(B, 1 x extra_dims, L, T): query i of row b (at pos[b] + i) sees keys 0..pos[b] + i."""
    qpos = (pos if isinstance(pos, mx.array) else mx.array(pos))[:, None] + mx.arange(L)[None]  # (B, L)
    mask = mx.arange(T)[None, None, :] <= qpos[:, :, None]  # (B, L, T)
    return mask.reshape(mask.shape[0], *([1] * extra_dims), L, T)


def page_heads(table: mx.array, H: int) -> tuple[mx.array, mx.array]:
    """For reading pages in place with gather_mm / gather_qmm: (B, H, n) the (page * H + head)
    of each row's pages in `table` (B, n), and (B, H, 1) the query group b * H + head."""
    B = table.shape[0]
    heads = (table[:, None, :] * H + mx.arange(H, dtype=mx.int32)[None, :, None]).astype(mx.uint32)
    return heads, mx.arange(B * H, dtype=mx.uint32).reshape(B, H, 1)


@dataclass(frozen=True)
class TailWrites:
    """A decode step's writes into q8/q4 tails: the head rows of each row's new token in its tail
    page, and for rows whose tail fills, what to seal: with keys per token (a tail page and a
    packed page then share the (kv_heads, page_size) layout) the tail ids and page ids
    (`seal_pages`: per layer one gather, one quantize and three one-index writes per K and V);
    with keys per channel the tail slots and pool slots (`seal_from`, `seal_to`)."""

    tail_write: mx.array
    seal_pages: Optional[tuple[mx.array, mx.array]] = None
    seal_from: Optional[mx.array] = None
    seal_to: Optional[mx.array] = None

    def apply(self, store, layer: int, k: mx.array, v: mx.array) -> None:
        """Write the new tokens into their tails, then seal the tails that filled."""
        store.write_tokens(layer, self.tail_write, k, v)  # a step that seals writes first (the seal reads it)
        if self.seal_pages is not None:
            store.seal_tail_pages(layer, *self.seal_pages)
        elif self.seal_from is not None:
            store.seal_tails(layer, self.seal_from, self.seal_to)


def tail_writes(P: int, H: int, k_axis: str, rows: list[CacheRow], pos: list[int], tails: list[int],
                fill: list[int], counts: list[int] | None = None) -> TailWrites:
    """The TailWrites of one token per row at positions `pos` (fill: tokens in each tail before it),
    or of counts[i] tokens of row i from there, all in its tail page (a row's written tokens in order,
    row after row); a row whose tokens complete the page seals it."""
    n = counts or [1] * len(rows)
    slots = [a * P + f + j for a, f, c in zip(tails, fill, n) for j in range(c)]
    tail_write = mx.array(head_rows(slots, P, H), dtype=mx.int32)
    done = [i for i, (f, c) in enumerate(zip(fill, n)) if f + c == P]
    if done and k_axis == "token":
        return TailWrites(tail_write, seal_pages=(mx.array([tails[i] for i in done], dtype=mx.int32),
                                                  mx.array([rows[i].pages[pos[i] // P] for i in done], dtype=mx.int32)))
    if done:
        return TailWrites(tail_write,
                          seal_from=mx.array([tails[i] * P + j for i in done for j in range(P)], dtype=mx.int32),
                          seal_to=mx.array([rows[i].pages[pos[i] // P] * P + j for i in done for j in range(P)],
                                           dtype=mx.int32))
    return TailWrites(tail_write)
