"""The portable route's decode: attention that reads each row's pages where they lie, with ops every
MLX backend has (what Apple's Metal backend runs; `engine.options.route=portable` runs it anywhere).

A page-table gather would copy every row's K/V into contiguous arrays before attention reads them:
each decode step then moves every KV byte twice and holds a copy of a layer's K/V as workspace
(102% of the KV in use on a one-layer model). Here `mx.gather_mm` (kv none) and `mx.gather_qmm`
(q8/q4/k8v4: packed pages, never dequantized) multiply each (row, KV head)'s query group by each of
its pages where it lies: scores are (G x D) @ (D x P) products over a transposed view of the page, so
a product's rows are the group's G queries (the orientation that reads K fastest: 0.44 against 0.54 ms a
layer for the page-major one at 1B geometry, batch 8, 16k on MLX CUDA). kv none takes the key scores of
all pages at once (G scores per key, small beside the page's K and V), one float32 softmax with MLX's
own `mx.softmax`, then the values in blocks of pages (`value_cuts`), each block's per-page products
summed before the next. q8/q4,
whose pages are 2-4x smaller than their float32 scores' share would allow, take scores and values
block by block with a running softmax (as flash-decoding does), reading the rows' dense tail pages
in place too. Either way the workspace stays a small share of the KV read. A pass of a few tokens a
row (a speculative verification window: the row's token and its proposals; for q8/q4 one that stays
in each row's tail page) reads the pages the same way, each page's products taking the group's
G x L queries, each query masked to the keys up to its own position. Longer passes (prefill) keep
gather + MLX's SDPA (routes/dense.py, routes/quant.py): a chunk's many queries amortize the gather,
and SDPA's fused kernel is Metal's fastest attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, cast

import mlx.core as mx

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.store import DenseStore, QuantizedStore
from kvbatch.engine.kv.routes.base import Geometry, real_tokens
from kvbatch.engine.kv.routes.common import TailWrites, page_heads
from kvbatch.engine.kv.routes.dense import DenseRoute, DenseStep, multi_query_mask
from kvbatch.engine.kv.routes.quant import QuantRoute

# The most bytes a block's per-page work (G x D products; for q8/q4 also its float32 scores) may take,
# as a share of the bytes its pages hold: more blocks keep the step's workspace down, fewer keep its
# graph small (each q8/q4 block is ~15 ops a layer, each one a kernel on Metal).
VALUE_SHARE = 1 / 64
MAX_VALUE_BLOCKS = 16
# The most (row, KV head, page) products one gather_mm / gather_qmm call may take: MLX CUDA launches them
# on a grid's z dimension, whose limit this is (a batch of 32 rows at 16k context with 8 KV heads and pages
# of 64 is 65,792 and fails to launch); a larger step runs in groups of rows.
MAX_GATHER_BATCH = 65_535


def value_cuts(n_pages: int, product_bytes: int, page_bytes: int) -> list[int]:
    """Page boundaries of the blocks of a step over n_pages pages a row: product_bytes, one page's
    work per KV head; page_bytes, what a page holds per KV head (K and V)."""
    k = min(max(n_pages, 1), MAX_VALUE_BLOCKS, max(1, -(-product_bytes // max(1, int(VALUE_SHARE * page_bytes)))))
    return [n_pages * i // k for i in range(k + 1)]


def row_groups(rows: int, per_row: int) -> list[tuple[int, int]]:
    """The step's rows in groups of at most MAX_GATHER_BATCH // per_row (at least one): per_row, the
    products one row's attention takes in one call (kv heads x pages)."""
    size = max(1, MAX_GATHER_BATCH // max(per_row, 1))
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]


def in_groups(groups: list[tuple[int, int]], attend: Callable[[int, int], mx.array]) -> mx.array:
    """attend(a, z) for rows a..z of every group, the outputs in row order (one call when one group).
    query_of is b * Hkv + head from 0, so a group's is the first (z - a) rows' of the step's."""
    if len(groups) == 1:
        return attend(*groups[0])
    return mx.concatenate([attend(a, z) for a, z in groups], axis=0)


def keys_softmax(scores: mx.array, mask: mx.array, axis: int | tuple[int, ...]) -> mx.array:
    """softmax(where(mask, scores, -inf)) along `axis`, in float32 (MLX's precise softmax)."""
    s = scores.astype(mx.float32)
    return mx.softmax(mx.where(mask, s, mx.array(-mx.inf, mx.float32)), axis=axis, precise=True)


def portable_paged_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, heads: mx.array, query_of: mx.array,
                          mask: mx.array, scale: float, cuts: list[int]) -> mx.array:
    """Attention of each row's query (decode) or few queries read from dense pages in place.

    q (B, Hq, L, D); k_pages, v_pages (pages, Hkv, P, D); heads (B, Hkv, n): the (page * Hkv + head)
    of each row's n pages; query_of (B, Hkv, 1): b * Hkv + head; mask (B, 1, n, 1, P): each row's
    valid keys, or (B, 1, n, G * L, P): each query's; cuts: the value blocks' page boundaries
    (`value_cuts`). Scores come out (B, Hkv, n, G * L, P), the layout the value products take as it
    is. The query is scaled before the product, as MLX's SDPA does; products run in the pages' dtype."""
    B, Hq, L, D = q.shape
    _, Hkv, P, _ = k_pages.shape
    G, dt = Hq // Hkv * L, k_pages.dtype
    qs = (q * mx.array(scale, q.dtype)).astype(dt).reshape(B * Hkv, G, D)
    scores = mx.gather_mm(qs, k_pages.reshape(-1, P, D).swapaxes(-1, -2), query_of, heads)  # (B, Hkv, n, G, P)
    probs = keys_softmax(scores, mask, axis=(2, 4)).astype(dt)
    vp = v_pages.reshape(-1, P, D)
    out = None
    for a, z in zip(cuts, cuts[1:]):
        part = mx.gather_mm(probs[:, :, a:z], vp, None, heads[..., a:z])  # (B, Hkv, z - a, G, D)
        s = part.astype(mx.float32).sum(axis=2)
        out = s if out is None else out + s
    assert out is not None  # cuts hold at least one block
    return out.reshape(B, Hq, L, D).astype(q.dtype)


def portable_quantized_decode(q: mx.array, kq: list[mx.array], vq: list[mx.array],
                              dense: list[tuple[mx.array, mx.array]], dense_heads: mx.array, heads: mx.array,
                              query_of: mx.array, mask: mx.array, scale: float, group_size: int,
                              bits: tuple[int, int], cuts: list[int]) -> mx.array:
    """Attention of each row's query (decode) or few queries (a verification window in its tail page)
    over packed pages and each row's dense pages (its tail and, with kv.full_precision_tokens, its
    first-token copy), all read where they lie.

    kq, vq: the layer's K and V pool triplets, (pages * Hkv, P, ·); dense: the tail pages (slots, Hkv, P, D)
    and, when attended, the first-token copies (slots, Hkv, N, D), each as (K, V); dense_heads (B, Hkv, 1):
    tail slot * Hkv + head; heads, query_of as in `portable_paged_decode` (of the rows' sealed pages);
    mask (B, 1, 1 [+ m] + n, Q, P): the tail's valid keys[, the copy's, m pages' worth] and the sealed
    pages' (routes/quant.py quantized_paged_plan), Q = 1 (the same for every query) or G * L (each
    query's). The dense pages first, then the sealed pages block by block (`cuts`) with a running
    softmax: float32 scores are G x 4 bytes a key and KV head, large beside 8- and 4-bit pages, so only
    one block's scores exist at a time. The tail holds the step's own token,
    so the running maximum is finite from the first block on and a block with no valid key adds nothing."""
    B, Hq, L, D = q.shape
    _, Hkv, P, _ = dense[0][0].shape
    G, dt = Hq // Hkv * L, dense[0][0].dtype  # a KV head's queries: its group's, at each of the L positions
    kbits, vbits = bits
    qs = (q * mx.array(scale, q.dtype)).astype(dt).reshape(B * Hkv, G, D)
    qt = qs.swapaxes(-1, -2)  # (B*Hkv, D, G)
    neg = mx.array(-mx.inf, mx.float32)
    top = total = out = None
    Q = mask.shape[3]
    valid = [mask[:, :, :1].swapaxes(-1, -2)]  # (B, 1, 1, P, Q) key-major, as gather_mm gives the dense scores
    if len(dense) > 1:
        N, m = dense[1][0].shape[2], -(-dense[1][0].shape[2] // P)
        copy = mask[:, :, 1:1 + m].transpose(0, 1, 3, 2, 4).reshape(B, 1, Q, m * P)  # the copy's keys, in order
        valid.append(copy.swapaxes(-1, -2)[:, :, None, :N])
    for (keys, values), ok in zip(dense, valid):
        # key-major here: a transposed view of the tail pages, rewritten this step, costs a copy of them
        K = keys.shape[2]
        s = mx.gather_mm(keys.reshape(-1, K, D), qt, dense_heads, query_of).astype(mx.float32)  # (B, Hkv, 1, K, G)
        s = mx.where(ok, s, neg)
        block_top = s.max(axis=(2, 3))  # (B, Hkv, G)
        new_top = block_top if top is None else mx.maximum(top, block_top)
        p = mx.exp(s - new_top[:, :, None, None])
        part = mx.gather_mm(p.astype(dt).swapaxes(-1, -2), values.reshape(-1, K, D), None, dense_heads)
        part, mass = part[:, :, 0].astype(mx.float32), p.sum(axis=(2, 3))  # (B, Hkv, G, D), (B, Hkv, G)
        if top is None or total is None or out is None:
            out, total = part, mass
        else:
            keep = mx.exp(top - new_top)
            out, total = out * keep[..., None] + part, total * keep + mass
        top = new_top
    assert top is not None and total is not None and out is not None  # the tail is always attended
    first_sealed = mask.shape[2] - heads.shape[-1]
    for a, z in zip(cuts, cuts[1:]):
        s = mx.gather_qmm(qs, kq[0], kq[1], kq[2], lhs_indices=query_of, rhs_indices=heads[..., a:z],
                          transpose=True, group_size=group_size, bits=kbits).astype(mx.float32)  # (B, Hkv, z-a, G, P)
        s = mx.where(mask[:, :, first_sealed + a:first_sealed + z], s, neg)
        new_top = mx.maximum(top, s.max(axis=(2, 4)))
        keep = mx.exp(top - new_top)
        p = mx.exp(s - new_top[:, :, None, :, None])
        part = mx.gather_qmm(p.astype(dt), vq[0], vq[1], vq[2], rhs_indices=heads[..., a:z], transpose=False,
                             group_size=group_size, bits=vbits)  # (B, Hkv, z - a, G, D)
        out = out * keep[..., None] + part.astype(mx.float32).sum(axis=2)
        total = total * keep + p.sum(axis=(2, 4))
        top = new_top
    return (out / total[..., None]).reshape(B, Hq, L, D).astype(q.dtype)


def _page_bytes(arrays: list[mx.array]) -> int:
    """Bytes one page holds per KV head, over these (pages, kv_heads, ...) arrays."""
    total = 0
    for a in arrays:
        per = a.dtype.size
        for d in a.shape[2:]:
            per *= d
        total += per
    return total


@dataclass(frozen=True)
class PortableStep:
    """A portable decode step: where its tokens go, and the rows' pages to read in place."""

    rows: mx.array  # head rows the step's tokens are written to (kv.store.head_rows)
    heads: mx.array  # (B, Hkv, n) page * Hkv + head
    query_of: mx.array  # (B, Hkv, 1)
    mask: mx.array  # (B, 1, n, 1, P) valid keys
    cuts: list[int]  # value blocks (value_cuts)
    groups: list[tuple[int, int]]  # the rows of each attention call (row_groups)
    take: Optional[mx.array] = None  # a few-token pass: its real tokens (DenseRoute.write reads it)


class PortableDenseRoute(DenseRoute):
    """kv none on the portable route: decode reads the pages in place (`portable_paged_decode`);
    prefill, and fp16 models (whose scores are taken in float32, DenseRoute's upcast), gather + SDPA."""

    def __init__(self, store: DenseStore, geom: Geometry, upcast: bool, multi_query: int = 1):
        super().__init__(store, geom, upcast, cpu=False, in_place=False, multi_query=multi_query)

    def plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> object:
        """A few tokens a row read in place, each query over its own keys; other passes as DenseRoute plans them."""
        if 1 < L <= self.multi_query and not self.upcast:
            step = self.prefill_plan(rows, L, pos, lens, mask=False)
            P, G = self.geom.page_size, self.geom.query_heads // self.geom.kv_heads
            width = step.table.shape[1]
            mask = multi_query_mask(pos, lens, L, width * P, G)  # (B, 1, T, G * L) key-major
            mask = mask.reshape(len(rows), 1, width, P, G * L).swapaxes(-1, -2)
            return self._in_place(step.rows, step.table, mask, L, step.take)
        return super().plan(rows, L, pos, lens)

    def chained_plan(self, rows: list[CacheRow], L: int, pos: mx.array, n_pages: list[int]) -> Optional[object]:
        """A chained window (Route.chained_plan) read in place as `plan` reads a window; else as DenseRoute's."""
        if not (1 < L <= self.multi_query and not self.upcast):
            return super().chained_plan(rows, L, pos, n_pages)
        P, G = self.geom.page_size, self.geom.query_heads // self.geom.kv_heads
        table, hrows = self.chained_writes(rows, L, pos, n_pages)
        width = table.shape[1]
        mask = multi_query_mask(pos, None, L, width * P, G).reshape(len(rows), 1, width, P, G * L).swapaxes(-1, -2)
        return self._in_place(hrows, table, mask, L)

    def decode_plan(self, rows: list[CacheRow], pos: list[int]) -> DenseStep | PortableStep:  # type: ignore[override]
        """A one-token pass read in place, built from Python lists (see DenseRoute.decode_plan)."""
        if self.upcast:
            return super().decode_plan(rows, pos)
        table, hrows, mask = self.decode_slots(rows, pos)
        return self._in_place(hrows, table, mask.reshape(len(rows), 1, table.shape[1], 1, self.geom.page_size), 1)

    def _in_place(self, hrows: mx.array, table: mx.array, mask: mx.array, L: int,
                  take: Optional[mx.array] = None) -> PortableStep:
        """A pass of L queries a row read in place: the rows' pages, value blocks and attention calls."""
        H, (B, width) = self.geom.kv_heads, table.shape
        heads, query_of = page_heads(table, H)
        st = self.store
        GL = self.geom.query_heads // H * L
        cuts = value_cuts(width, GL * self.geom.head_dim * st.dtype.size, _page_bytes([st.k[0], st.v[0]]))
        return PortableStep(hrows, heads, query_of, mask, cuts, row_groups(B, H * width), take)

    def attend(self, layer: int, meta: object, queries: mx.array, scale: float) -> mx.array:
        """Decode in place; other passes as DenseRoute attends them."""
        if isinstance(meta, PortableStep):
            st = self.store
            return in_groups(meta.groups, lambda a, z: portable_paged_decode(
                queries[a:z], st.k[layer], st.v[layer], meta.heads[a:z], meta.query_of[:z - a], meta.mask[a:z],
                scale, meta.cuts))
        return super().attend(layer, cast(DenseStep, meta), queries, scale)


@dataclass(frozen=True)
class PortableQuantStep:
    """A portable q8/q4 decode step over sealed pages: tail writes, the pages to read in place, masks."""

    tail_heads: mx.array  # (B, Hkv, 1) tail slot * Hkv + head: the rows' dense pages
    writes: TailWrites
    heads: mx.array
    query_of: mx.array
    mask: mx.array  # (B, 1, 1 [+ m] + n, 1, P)
    cuts: list[int]
    groups: list[tuple[int, int]]  # the rows of each attention call (row_groups)
    first: bool = False  # attend to the rows' dense first-token copies (kv.full_precision_tokens)
    take: Optional[mx.array] = None  # a few-token pass: its real tokens (base.real_tokens)


class PortableQuantRoute(QuantRoute):
    """q8/q4/k8v4 on the portable route (keys per token): decode over sealed pages reads them in
    place (`portable_quantized_decode`); steps with no sealed page, prefill, and fp16 models (whose
    scores are taken in float32) as QuantRoute."""

    def __init__(self, store: QuantizedStore, geom: Geometry, multi_query: int = 1, upcast: bool = True):
        super().__init__(store, geom, [None], in_place=False, multi_query=multi_query, upcast=upcast)

    def plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> object:
        """Decode steps whose rows hold sealed pages read them in place, and so do passes of a few tokens a
        row that stay in each row's tail page (verification windows); other passes as QuantRoute plans them."""
        P, H, D = self.geom.page_size, self.geom.kv_heads, self.geom.head_dim
        st = self.store
        # fp16 stores: scores past fp16's range; QuantRoute's gathered decode takes them in float32
        if (L > 1 and not self.window_in_tails(L, pos, lens)) or max(pos) < P or st.dtype == mx.float16:
            return super().plan(rows, L, pos, lens)
        counts = lens if L > 1 else None
        tails, writes, t, use_first = self.tail_plan(rows, pos, counts, [None])
        heads = t["q_page_heads"]
        G = self.geom.query_heads // H * L
        # a block's float32 scores, their exponentials and mask (3 x 4 bytes a key) beside its products
        cuts = value_cuts(heads.shape[-1], G * (D * st.dtype.size + 12 * P), _page_bytes(st.q[0]))
        tail_heads, _ = page_heads(mx.array(tails, dtype=mx.int32)[:, None], H)
        return PortableQuantStep(tail_heads, writes, heads, t["query_of"], t["mask_p"], cuts,
                                 row_groups(len(rows), H * heads.shape[-1]), use_first,
                                 real_tokens(L, lens) if counts else None)

    def attend(self, layer: int, meta, queries: mx.array, scale: float) -> mx.array:
        """A step read in place; other passes as QuantRoute attends them."""
        if not isinstance(meta, PortableQuantStep):
            return super().attend(layer, meta, queries, scale)
        st = self.store
        q = [a.reshape(-1, *a.shape[2:]) for a in st.q[layer]]  # (pages * Hkv, P, ·)
        dense = [(st.tk[layer], st.tv[layer])] + ([(st.fk[layer], st.fv[layer])] if meta.first else [])
        return in_groups(meta.groups, lambda a, z: portable_quantized_decode(
            queries[a:z], q[:3], q[3:], dense, meta.tail_heads[a:z], meta.heads[a:z], meta.query_of[:z - a],
            meta.mask[a:z], scale, st.group_size, (st.key_bits, st.value_bits), meta.cuts))
