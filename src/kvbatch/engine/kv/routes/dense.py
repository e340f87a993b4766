"""kv none: attention over dense pages.

Portable (what Apple's Metal backend runs): each pass gathers the rows' pages through a page
table into contiguous K/V, then MLX's fast SDPA with a padding+causal mask. On the CPU, decode
folds each KV head's query group into one matmul (`_grouped_decode`, which MLX's CPU SDPA does
not do) and, for float32 pages of IN_PLACE_MIN_PAGE+ tokens, reads the pages where they lie
(`paged_grouped_decode`, no gathered copy). fp16 models attend in float32 (`paged_sdpa_f32`):
scores can exceed fp16's range, and MLX's CPU fallback computes q·kᵀ in the input dtype.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.store import DenseStore, head_rows, head_rows_array
from kvbatch.engine.kv.routes.base import Geometry, Route, flat_tokens, real_tokens
from kvbatch.engine.kv.routes.cpu_streams import stream_split
from kvbatch.engine.kv.routes.common import (PageTables, causal_mask, page_heads, page_table, pass_slots, window_last,
                                             window_rows)
from kvbatch.engine.kv.routes.softmax_cpu import masked_softmax

ROUTE_DENSE = "paged_sdpa"
ROUTE_DENSE_F32 = "paged_sdpa_f32"


def dense_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, upcast: bool,
                    grouped: bool = False, composed: bool = False) -> mx.array:
    """q (B,Hq,L,D); k, v (B,Hkv,T,D); mask bool (B,1,L,T). grouped: one-query passes fold each
    KV head's query group into one matmul (`_grouped_decode`; the CPU's decode). composed:
    multi-token passes run `composed_attention` instead of MLX's fused SDPA (MLX CUDA)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)
    if q.shape[2] == 1 and grouped:
        out = _grouped_decode(q, k, v, mask, scale)
    elif composed and q.shape[2] > 1:
        out = composed_attention(q, k, v, mask, scale)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.astype(dtype)


def composed_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float) -> mx.array:
    """Attention as two matmuls around a float32-accurate softmax, each KV head's query group
    folded into the rows of one matmul (what MLX's own SDPA fallback computes).

    On MLX CUDA, fused SDPA runs a multi-token 2-byte pass through cuDNN, which builds a graph for
    every new shape (~60 ms each) after a one-time set-up of ~17 s; batched prefill passes of mixed
    prompt lengths meet a new shape nearly every pass. cuBLAS matmuls need no per-shape set-up and
    run these passes as fast (docs/performance.md). Masked keys get the dtype's lowest
    value, not -inf, so a padded query that sees no key gets finite (unused) outputs."""
    B, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    qg = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, rep * L, D)
    scores = (qg @ k.swapaxes(-1, -2)).reshape(B, Hkv, rep, L, T)
    scores = mx.where(mask.reshape(B, 1, 1, L, T), scores, mx.finfo(scores.dtype).min)
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hkv, rep * L, T)
    return (probs @ v).reshape(B, Hq, L, D)


def _grouped_decode(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float) -> mx.array:
    """One-query attention with each KV head's query group folded into the rows of one matmul.

    MLX's CPU SDPA (a composed fallback) broadcasts K/V over the group: one GEMV per query
    head, reading each KV head's K and V once per query head. Folded, it is one small GEMM
    per (row, KV head) that reads them once: 30-37% less attention time at SmolLM2 and
    tiny-llama shapes, bit-identical results (docs/performance.md)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qf = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, Hq // Hkv, D)
    scores = qf @ k.swapaxes(-1, -2)  # (B, Hkv, rep, T)
    probs = masked_softmax(scores, mask)
    return (probs @ v).reshape(B, Hq, 1, D)


# Smallest page (tokens) for which decode reads the pages in place (`paged_grouped_decode`):
# it runs two small matmuls per (row, KV head, page), so tiny pages would mean many tiny ones.
IN_PLACE_MIN_PAGE = 16


def paged_grouped_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, page_heads: mx.array,
                         query_of: mx.array, mask: mx.array, scale: float) -> mx.array:
    """`_grouped_decode` read from the pages in place: no gathered copy of K/V.

    q (B, Hq, L, D); k_pages, v_pages (pages, Hkv, P, D); page_heads (B, Hkv, n): the
    (page * Hkv + head) of each row's n pages; query_of (B, Hkv, 1): b * Hkv + head;
    mask (B, 1, n * P, 1) for one query a row, or (B, 1, n * P, G * L) with each query's own
    keys (`multi_query_mask`: a verification window's causal mask). `mx.gather_mm` multiplies
    each page where it lies by its (row, KV head)'s G * L queries: scores come out key-major,
    (B, Hkv, n * P, G * L), so the softmax runs down the keys axis and neither product needs a
    transposed copy. On the CPU a page-table gather copies K and V at ~10 GB/s before attention
    can read them; in place, decode attention takes 0.35-0.8x the time at tiny-llama and
    SmolLM2 shapes (docs/performance.md). Same float32 softmax; the output sums the pages'
    partial products (within 1e-6 of the gathered path)."""
    B, Hq, L, D = q.shape
    _, Hkv, P, _ = k_pages.shape
    GL, n = Hq // Hkv * L, page_heads.shape[-1]
    qt = q.reshape(B * Hkv, GL, D).swapaxes(-1, -2)  # (B*Hkv, D, G*L), a view
    scores = mx.gather_mm(k_pages.reshape(-1, P, D), qt, page_heads, query_of)  # (B, Hkv, n, P, G*L)
    probs = masked_softmax(scores.reshape(B, Hkv, n * P, GL), mask, axis=-2, scale=scale)  # scaled in the kernel
    pt = probs.reshape(B * Hkv * n, P, GL).swapaxes(-1, -2)  # (.., G*L, P), a view
    out = mx.gather_mm(pt, v_pages.reshape(-1, P, D), None, page_heads.reshape(-1))  # (B*Hkv*n, G*L, D)
    return out.reshape(B, Hkv, n, GL, D).sum(axis=2).reshape(B, Hq, L, D)


def multi_query_mask(pos: list[int] | mx.array, lens: Optional[list[int]], L: int, T: int, group: int) -> mx.array:
    """(B, 1, T, group * L) key-major: query j of row b (each of its KV heads' `group` query heads)
    sees keys 0..pos[b] + j; a padding position (j >= lens[b]) sees the row's real keys. pos as a
    device array (a chained pass): every row's L tokens are real (lens None)."""
    if isinstance(pos, mx.array):
        last = pos[:, None] + mx.arange(L, dtype=mx.int32)[None, :]
    else:
        assert lens is not None
        last = mx.array(window_last(pos, lens, L))  # (B, L)
    mask = mx.arange(T)[None, :, None] <= last[:, None, :]  # (B, T, L)
    return mx.tile(mask, (1, 1, group))[:, None]


@dataclass(frozen=True)
class InPlaceGroup:
    """One group of a decode step's rows, read in place on its own CPU stream."""

    start: int  # the group's rows are start:stop of the batch
    stop: int
    page_heads: mx.array  # (rows, Hkv, n) page * Hkv + head
    query_of: mx.array  # (rows, Hkv, 1), numbered within the group
    mask: mx.array  # (rows, 1, T, 1), key-major
    stream: Optional[mx.Stream]  # None: the caller's stream


@dataclass(frozen=True)
class DenseStep:
    """A dense pass's metadata: where its tokens are written, the page table, the mask and the in-place groups."""

    rows: mx.array  # head rows the pass's tokens are written to (kv.store.head_rows)
    table: mx.array  # (B, width) page table
    mask: Optional[mx.array] = None  # (B, 1, L, T)
    groups: tuple[InPlaceGroup, ...] = ()  # in place: the rows by stream
    take: Optional[mx.array] = None  # prefill: the real tokens of the padded pass (base.real_tokens)


class DenseRoute(Route):
    """kv none: attention over dense pages, gathered through the page table (or read in place on the CPU)."""

    def __init__(self, store: DenseStore, geom: Geometry, upcast: bool, cpu: bool, in_place: bool,
                 streams: Optional[list] = None, multi_query: int = 1):
        """cpu: the CPU's decode (grouped matmul); in_place: also read float32 pages in place;
        streams: CPU streams that in-place decode spreads its rows over (cpu_streams.py);
        multi_query: passes of 2 to this many tokens a row are read like decode (EngineOptions.multi_query)."""
        self.store, self.geom, self.upcast, self.grouped = store, geom, upcast, cpu
        self.in_place, self.streams, self.multi_query = in_place, streams or [None], multi_query
        self.composed = False  # multi-token passes through composed_attention (the CUDA route)
        self.name = ROUTE_DENSE_F32 if upcast else ROUTE_DENSE
        self.tables = PageTables()  # decode steps' page tables

    def plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> object:
        """A decode plan for one-token passes; for a few tokens a row read in place, the decode plan's
        reads with each query's own keys (`multi_plan`); a prefill plan otherwise."""
        if L == 1:
            return self.decode_plan(rows, pos)
        if self.in_place and L <= self.multi_query:
            return self.multi_plan(rows, L, pos, lens)
        return self.prefill_plan(rows, L, pos, lens)

    def multi_plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> DenseStep:
        """A few tokens a row: written as a prefill chunk's, attended in place like decode, each query
        over the keys up to its own position."""
        step = self.prefill_plan(rows, L, pos, lens, mask=False)
        g = self.geom
        mask = multi_query_mask(pos, lens, L, step.table.shape[1] * g.page_size, g.query_heads // g.kv_heads)
        return DenseStep(step.rows, step.table, groups=self._groups(step.table, mask), take=step.take)

    def prefill_plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int],
                     mask: bool = True) -> DenseStep:
        """A multi-token pass (prefill chunks of several rows, right-padded to L): only the real
        tokens are stored; a real query sees only keys at or before it, all real. mask=False: no
        causal mask (a route that attends by key counts)."""
        P = self.geom.page_size
        # a window-sized pass (a verification window) runs the decode step's rows: their table is the decode
        # tables' with a few rows moved; a prefill chunk's rows are others, built apart so as not to cost the
        # next decode step a whole table
        tokens, table = pass_slots(rows, P, pos, lens, self.tables if L <= self.multi_query else None)
        return DenseStep(mx.array(head_rows_array(tokens, P, self.geom.kv_heads)), table,
                         causal_mask(np.array(pos, dtype=np.int32), L, table.shape[1] * P, 1) if mask else None,
                         take=real_tokens(L, lens))

    def chained_plan(self, rows: list[CacheRow], L: int, pos: mx.array, n_pages: list[int]) -> Optional[object]:
        """A window of L tokens a row at device positions `pos` (a chained verification pass: see
        Route.chained_plan), each row's table its first n_pages pages; read as `plan` reads such a window."""
        g, P = self.geom, self.geom.page_size
        table, hrows = self.chained_writes(rows, L, pos, n_pages)
        T = table.shape[1] * P
        if self.in_place and L <= self.multi_query:
            return DenseStep(hrows, table, groups=self._groups(table, multi_query_mask(pos, None, L, T,
                                                                                        g.query_heads // g.kv_heads)))
        return DenseStep(hrows, table, causal_mask(pos, L, T, 1))

    def chained_writes(self, rows: list[CacheRow], L: int, pos: mx.array,
                       n_pages: list[int]) -> tuple[mx.array, mx.array]:
        """A chained window's page table (the decode tables' for a window-sized pass, as pass_slots builds it)
        and the head rows its tokens are written to, found on the device from its positions."""
        table = mx.array(self.tables.padded(rows, n_pages)) if L <= self.multi_query else page_table(rows, n_pages)
        return table, window_rows(table, pos, L, self.geom.page_size, self.geom.kv_heads)

    def decode_slots(self, rows: list[CacheRow], pos: list[int]) -> tuple[mx.array, mx.array, mx.array]:
        """A one-token pass's page table, the head rows its new token is written to, and the (B, T) mask of
        the keys each row attends to. Built from Python lists: right after a step's compute numpy costs
        ~10 us an op on arrays of a few rows (cold caches), and these are a few dozen numbers."""
        P, H = self.geom.page_size, self.geom.kv_heads
        new_len = [a + 1 for a in pos]
        table = self.tables.table(rows, [-(-n // P) for n in new_len])
        slots = [r.pages[a // P] * P + a % P for r, a in zip(rows, pos)]
        hrows = mx.array(head_rows(slots, P, H), dtype=mx.int32)
        mask = mx.arange(table.shape[1] * P) < mx.array(new_len, dtype=mx.int32)[:, None]
        return table, hrows, mask

    def decode_plan(self, rows: list[CacheRow], pos: list[int]) -> DenseStep:
        """A one-token pass (decode_slots), attended in place or over the gathered pages."""
        P, B = self.geom.page_size, len(rows)
        table, hrows, mask = self.decode_slots(rows, pos)
        width = table.shape[1]
        if not self.in_place:
            return DenseStep(hrows, table, mask.reshape(B, 1, 1, width * P))
        return DenseStep(hrows, table, groups=self._groups(table, mask.reshape(B, 1, width * P, 1)))

    def _groups(self, table: mx.array, mask: mx.array) -> tuple[InPlaceGroup, ...]:
        """The step's rows in groups, one per stream: attention over one row reads only its own
        pages, so the groups run side by side and each row's output is bit-identical to an
        unsplit step's. A group is worth its hand-off from cpu_streams.MIN_WORK elements on."""
        B, H = table.shape[0], self.geom.kv_heads
        n = stream_split(B * H, table.shape[1] * self.geom.page_size, self.geom.head_dim, min(len(self.streams), B))
        cuts = [B * i // n for i in range(n + 1)]
        groups = []
        for stream, a, z in zip(self.streams, cuts, cuts[1:]):
            heads, query_of = page_heads(table[a:z], H)  # key-major scores (paged_grouped_decode)
            groups.append(InPlaceGroup(a, z, heads, query_of, mask[a:z], stream))
        return tuple(groups)

    def write(self, layer: int, meta: DenseStep, keys: mx.array, values: mx.array) -> None:
        """Store the pass's real tokens' K/V in the head rows the plan chose."""
        k, v = flat_tokens(keys, values)
        if meta.take is not None:
            k, v = k[meta.take], v[meta.take]
        self.store.write(layer, meta.rows, k, v)

    def attend(self, layer: int, meta: DenseStep, queries: mx.array, scale: float) -> mx.array:
        """The pass's queries attending to the rows' dense pages (grouped or in place on the CPU, SDPA otherwise)."""
        st = self.store
        if meta.groups:
            outs = []
            for g in meta.groups:
                with mx.stream(g.stream) if g.stream is not None else nullcontext():
                    outs.append(paged_grouped_decode(queries[g.start:g.stop], st.k[layer], st.v[layer],
                                                     g.page_heads, g.query_of, g.mask, scale))
            return mx.concatenate(outs) if len(outs) > 1 else outs[0]
        k, v = st.gather(layer, meta.table)
        assert meta.mask is not None  # a step not read in place has its mask
        return dense_attention(queries, k, v, meta.mask, scale, self.upcast, self.grouped, self.composed)
