"""q8/q4/k8v4: attention over quantized pages (mx.quantize triplets) and each row's dense tail page.

Decode scores the packed pages with `mx.quantized_matmul`, never dequantizing the prefix, plus a
float32 matmul on the tail page; scores and softmax in float32 (on the CPU the quantized matmuls
are spread over several streams, see `cpu_streams.py`). CPU decode over float32 stores reads the
packed pages in place instead (`quantized_paged_decode`, `mx.gather_qmm`). Prefill attends in float32
to each row's segment at full precision (the tokens its tail page held before the pass, then the
pass's own) plus, dequantized once per pass, the pages sealed before it. Every row of a pass is
written and attended together, whatever its prompt position (as kv none's prefill is): one gather
builds the rows' segments, one quantizes the pages the pass completes, one writes the rest into the
tails, and one attention reads them, rows right-padded to the longest and masked.

kv.full_precision_tokens=N: each row's first N tokens are stored quantized like the rest and also
copied dense (kv/cache.py writes the copy, QuantizedStore.fk/fv). Wherever they are sealed, attention
reads them from the copy: decode masks them out of the quantized pages and attends to the copy as one
more dense block (as it does the tail); prefill puts the copy in place of their dequantized keys and
values. The scores and probabilities are then exactly those of dense first tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

import mlx.core as mx
import numpy as np

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.store import QuantizedStore, head_rows_array
from kvbatch.engine.kv.routes.base import Geometry, Route, flat_tokens, real_tokens
from kvbatch.engine.kv.routes.common import (PageTables, TailWrites, page_array, page_heads, page_table, tail_writes,
                                             window_last)
from kvbatch.engine.kv.routes.cpu_streams import stream_split
from kvbatch.engine.kv.routes.dense import dense_attention
from kvbatch.engine.kv.routes.softmax_cpu import masked_softmax

ROUTE_QMM = "paged_qmm_f32"

def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _split_bits(bits: int | tuple[int, int]) -> tuple[int, int]:
    """(key bits, value bits) from one number for both or the pair."""
    return (bits, bits) if isinstance(bits, int) else (bits[0], bits[1])


def quantized_decode_attention(q: mx.array, qk: list[mx.array] | list[list[mx.array]] | None,
                               qv: list[mx.array] | None, tk: mx.array, tv: mx.array, mask_q: mx.array,
                               mask_t: mx.array, scale: float, group_size: int, bits: int | tuple[int, int],
                               streams: list | None = None, k_transposed: bool = False,
                               mask: mx.array | None = None,
                               first: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """q (B,Hq,L,D); qk/qv packed triplets (B,Hkv,Tq,·) or None; tail tk/tv (B,Hkv,P,D); bits: of
    both, or (key bits, value bits).

    qk may also be a list of triplets, consecutive runs of pages that together make Tq
    (the key scores of run i are computed on streams[i]). mask_q (B,1,1,Tq) and mask_t
    (B,1,1,P) mark the valid keys (the same for every query of the pass). Queries of a
    KV head's group are folded into rows, (B, Hkv, rep*L, D): the 4-D shape that MLX's
    CUDA quantized_matmul implements for every head size (a 5-D broadcast shape has no
    CUDA kernel at head size 64).

    mask: mask_q and mask_t concatenated, if the caller has it (built once per step, not per layer).

    k_transposed: qk holds K^T quantized per channel, (B,Hkv,D,·) (QuantizedStore
    k_axis="channel"): the scores run as an untransposed quantized_matmul.

    first: the rows' dense first-token copies (fk, fv) (B,Hkv,N,D) (kv.full_precision_tokens), attended
    before the sealed pages; then `mask` is required: the copy's valid keys (B,1,1,N), then mask_q
    (which masks those tokens out of the sealed pages), then mask_t.

    With several streams the work splits so that no sum changes order: key scores by
    token runs (each score is its own dot product), value sums by (row, KV head). So a
    row's output is bit-identical however its batch is split.
    """
    B, Hq, L, D = q.shape
    Hkv = tk.shape[1]
    rep = Hq // Hkv
    dtype = q.dtype
    kbits, vbits = _split_bits(bits)
    streams = streams or [None]
    qf = (_f32(q) * scale).reshape(B, Hkv, rep * L, D)
    scores_t = qf @ _f32(tk).swapaxes(-1, -2)  # (B,Hkv,rep*L,P)
    parts, masks = [scores_t], [mask_t]
    if qk is not None:
        runs = cast("list[list[mx.array]]", qk) if isinstance(qk[0], (list, tuple)) else [cast("list[mx.array]", qk)]
        scores_q = [mx.quantized_matmul(qf, w, _f32(s), _f32(b), transpose=not k_transposed, group_size=group_size,
                                        bits=kbits, stream=streams[i % len(streams)])
                    for i, (w, s, b) in enumerate(runs)]
        parts[:0] = scores_q
        masks.insert(0, mask_q)
    F = 0
    if first is not None:
        F = first[0].shape[2]
        parts.insert(0, qf @ _f32(first[0]).swapaxes(-1, -2))
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    if mask is None:
        mask = mx.concatenate(masks, axis=-1) if len(masks) > 1 else masks[0]
    probs = masked_softmax(scores, mask)
    P = tk.shape[2]
    out = probs[..., -P:] @ _f32(tv)
    if F:
        assert first is not None
        out = out + probs[..., :F] @ _f32(first[1])
    if qk is not None:
        assert qv is not None  # given with qk
        w, s, b = (a.reshape(B * Hkv, *a.shape[2:]) for a in qv)
        s, b = _f32(s), _f32(b)
        pq = probs[..., F:-P].reshape(B * Hkv, rep * L, -1)
        n = stream_split(B * Hkv, pq.shape[-1], D, min(len(streams), B * Hkv))
        cuts = [B * Hkv * i // n for i in range(n + 1)]
        pv = [mx.quantized_matmul(pq[a:z], w[a:z], s[a:z], b[a:z], transpose=False, group_size=group_size,
                                  bits=vbits, stream=streams[i]) for i, (a, z) in enumerate(zip(cuts, cuts[1:]))]
        out = out + (mx.concatenate(pv) if n > 1 else pv[0]).reshape(B, Hkv, rep * L, D)
    out = out.reshape(B, Hq, L, D)
    return out if out.dtype == dtype else out.astype(dtype)


def quantized_paged_decode(q: mx.array, kq: list[mx.array], vq: list[mx.array], tk: mx.array, tv: mx.array,
                           page_heads: mx.array, query_of: mx.array, mask: mx.array, scale: float,
                           group_size: int, bits: int | tuple[int, int], streams: list | None = None,
                           cuts: list[int] | None = None, k_transposed: bool = True,
                           first: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """`quantized_decode_attention` read from the packed pages in place (CPU, float32 stores).

    q (B, Hq, L, D): decode's one query a row, or a few (a verification window, each query
    masked to its own keys by `mask`); kq: the layer's K pool triplet, K^T pages (pages, Hkv, D, ·) quantized
    per channel (k_transposed, QuantizedStore k_axis="channel") or K pages (pages, Hkv, P, ·)
    quantized per token; vq: its V triplet, (pages, Hkv, P, ·);
    tk, tv (B, Hkv, P, D): the rows' dense tail pages; page_heads (B, Hkv, n): the
    (page * Hkv + head) of each row's sealed pages; query_of (B, Hkv, 1): b * Hkv + head;
    mask (B, 1, 1 + n, Q, P): the tail's valid keys, then the sealed pages' (Q = 1: the same for
    every query; Q = G * L: each query's, `quantized_paged_plan` with lens).

    `mx.gather_qmm` multiplies each packed page where it lies by its (row, KV head)'s query
    group: no page-table gather of the packed K/V (and no K^T transpose copy). Scores come
    out page by page, (B, Hkv, 1 + n, G, P) with the tail first; the softmax runs over the
    (page, token) axes, and the values are a second gather_qmm per page, summed over pages.

    cuts: page boundaries of runs computed on streams[i] (key scores and value products
    alike); every run's pages are concatenated before the one sum over pages, so a row's
    output is bit-identical however the work is split, and padded (masked) pages add
    exact zeros.

    first: the rows' dense first-token copies (fk, fv) (B, Hkv, N, D) (kv.full_precision_tokens),
    padded to m whole pages and attended after the tail; mask then has 1 + m + n pages (the copy's
    valid keys after the tail's; those tokens masked out of the sealed pages).
    """
    B, Hq, L, D = q.shape
    Hkv = tk.shape[1]
    G, n = Hq // Hkv * L, page_heads.shape[-1]  # a KV head's queries: its group's, at each of the L positions
    kbits, vbits = _split_bits(bits)
    streams = streams or [None]
    runs = list(zip(cuts, cuts[1:])) if cuts else [(0, n)]
    qf = _f32(q).reshape(B * Hkv, G, D)
    kw, ks, kb = (a.reshape(-1, *a.shape[2:]) for a in kq)
    vw, vs, vb = (a.reshape(-1, *a.shape[2:]) for a in vq)
    parts = [(qf.reshape(B, Hkv, G, D) @ _f32(tk).swapaxes(-1, -2))[:, :, None]]  # the tail, (B,Hkv,1,G,P)
    P, m, fv = tk.shape[2], 0, None
    if first is not None:
        m = -(-first[0].shape[2] // P)
        pad = [(0, 0), (0, 0), (0, m * P - first[0].shape[2]), (0, 0)]
        fk, fv = (mx.pad(_f32(a), pad) if pad[2][1] else _f32(a) for a in first)  # (B, Hkv, m*P, D)
        sf = qf.reshape(B, Hkv, G, D) @ fk.swapaxes(-1, -2)  # (B, Hkv, G, m*P)
        parts.append(sf.reshape(B, Hkv, G, m, P).transpose(0, 1, 3, 2, 4))
    parts += [mx.gather_qmm(qf, kw, ks, kb, lhs_indices=query_of, rhs_indices=page_heads[..., a:z],
                            transpose=not k_transposed,
                            group_size=group_size, bits=kbits, stream=streams[i % len(streams)])
              for i, (a, z) in enumerate(runs)]  # (B, Hkv, z - a, G, P) each
    probs = masked_softmax(mx.concatenate(parts, axis=2), mask, axis=(2, 4), scale=scale)
    out = probs[:, :, 0] @ _f32(tv)  # (B, Hkv, G, D)
    if m:
        assert fv is not None
        out = out + probs[:, :, 1:1 + m].transpose(0, 1, 3, 2, 4).reshape(B, Hkv, G, m * P) @ fv
    pv = [mx.gather_qmm(probs[:, :, 1 + m + a:1 + m + z], vw, vs, vb, rhs_indices=page_heads[..., a:z],
                        transpose=False,
                        group_size=group_size, bits=vbits, stream=streams[i % len(streams)])
          for i, (a, z) in enumerate(runs)]  # (B, Hkv, z - a, G, D) each
    out = out + (mx.concatenate(pv, axis=2) if len(pv) > 1 else pv[0]).sum(axis=2)
    out = out.reshape(B, Hq, L, D)
    return out if out.dtype == q.dtype else out.astype(q.dtype)


def quantized_paged_plan(table: mx.array, n_before: list[int], fill: list[int], P: int, H: int, D: int,
                         streams: list, first: list[int] | None = None, N: int = 0,
                         lens: list[int] | None = None, group: int = 1) -> dict:
    """The per-step inputs of `attention.quantized_paged_decode`, built once for every layer:
    table (B, n) the rows' sealed pages (padded with their first), n_before their sealed page
    counts and fill their tail's tokens before this step's. first: each row's tokens read from its
    dense copy of N first tokens (masked out of the sealed pages), None: none. lens: a pass of
    lens[b] tokens a row in its tail (padded to the longest, L), whose query j sees the tail up to
    its own token; group: query heads per KV head (the mask then has one column per query)."""
    B, width = table.shape
    n = stream_split(B * H, width * P, D, min(len(streams), width))
    if lens is None:
        last = mx.array(fill)[:, None]  # (B, 1): this step's token included
    else:  # a padding position sees the row's real tokens
        last = mx.array(window_last(fill, lens, max(lens)))
    tail = mx.arange(P)[None, None] <= last[:, :, None]  # (B, L, P)
    if lens is not None:
        tail = mx.tile(tail, (1, group, 1))  # (B, G * L, P): a KV head's queries, group-major
    Q = tail.shape[1]
    pages = mx.arange(width)[None] < mx.array(n_before)[:, None]  # (B, width)
    pages = mx.broadcast_to(pages[:, :, None, None], (B, width, Q, P))
    blocks = [tail[:, None]]
    if first is not None:
        m = -(-N // P)
        f = mx.array(first)[:, None]
        copy = (mx.arange(m * P)[None] < f).reshape(B, m, 1, P)  # the copy's valid keys
        blocks.append(mx.broadcast_to(copy, (B, m, Q, P)))
        pages = pages & (mx.arange(width * P)[None] >= f).reshape(B, width, 1, P)
    mask = mx.concatenate(blocks + [pages], axis=1)
    heads, query_of = page_heads(table, H)
    return {"q_page_heads": heads, "query_of": query_of, "cuts": [width * i // n for i in range(n + 1)],
            "mask_p": mask.reshape(B, 1, mask.shape[1], Q, P)}


@dataclass(frozen=True)
class QuantPrefill:
    """A quantized prefill pass, every row together. Row b's segment is the tokens its tail page held
    before the pass (`fill` of them) and then its pass tokens, full precision, right-padded to S; the
    pass's sources are the rows' tail pages' tokens (b * P + i, when any row has some) followed by the
    pass's tokens (b * L + i)."""

    L: int
    S: int  # segment width: the longest fill + tokens
    tails: mx.array  # (B,) the rows' tail slots
    from_tails: bool  # whether any row's segment starts with tokens from its tail page
    seg: Optional[mx.array]  # (B * S,) each segment position's source (None: the pass's tokens as they are)
    page_src: Optional[mx.array]  # sources of the tokens of the pages the pass completes, page by page
    page_slots: Optional[mx.array]  # their pool slots (page * P + offset)
    tail_src: Optional[mx.array]  # sources of the tokens the tails keep
    tail_rows: Optional[mx.array]  # head rows of their tail slots
    table_q: Optional[mx.array]  # (B, n) pages sealed before the pass (padded with the row's own first page)
    mask: mx.array  # (B, 1, L, n * P + S): sealed keys, then the segment (causal)
    first: Optional[mx.array]  # (B, 1, F, 1): sealed first tokens read from the dense copies (F = min(N, n * P))


@dataclass(frozen=True)
class QuantDecode:
    """A quantized decode step's metadata: tails, sealed-page table, tail writes and masks."""

    tails: mx.array
    table_q: Optional[mx.array]
    writes: TailWrites
    mask_q: Optional[mx.array]  # (B, 1, 1, Tq) valid keys on sealed pages
    runs_q: Optional[list]  # the sealed pages' table in runs, one per stream
    mask_t: mx.array  # (B, 1, 1, P) valid keys in the tail
    mask_all: mx.array  # [the first-token copy's,] mask_q and mask_t concatenated (once per step)
    first: bool = False  # attend to the rows' dense first-token copies (kv.full_precision_tokens)


@dataclass(frozen=True)
class QuantPagedDecode:
    """CPU decode over float32 stores: the packed pages read in place."""

    tails: mx.array
    writes: TailWrites
    heads: mx.array
    query_of: mx.array
    cuts: list
    mask_p: mx.array
    first: bool = False  # see QuantDecode
    take: Optional[mx.array] = None  # a few-token pass: its real tokens (base.real_tokens)


class QuantRoute(Route):
    """q8/q4/k8v4: attention over quantized sealed pages plus each row's dense tail page."""

    name = ROUTE_QMM

    def __init__(self, store: QuantizedStore, geom: Geometry, streams: list, in_place: bool, multi_query: int = 1,
                 upcast: bool = True):
        """streams: see cpu_streams.py; in_place: CPU decode reads the packed pages in place; multi_query:
        in place, passes of 2 to this many tokens a row, each in its tail page, are read like decode; upcast:
        prefill attention in float32 (the CPU, whose float32 matmuls run on BLAS; fp16 models), else in the
        model's dtype as kv none's (GPU backends: a bf16 pass's matmuls on the tensor cores, where float32
        ones take several times as long)."""
        self.store, self.geom, self.streams, self.in_place, self.upcast = store, geom, streams, in_place, upcast
        self.multi_query = multi_query
        self.composed = False  # prefill attention through dense.composed_attention (the CUDA route)
        self._segment: dict[int, tuple[mx.array, ...]] = {}  # prefill: the rows' segments (K, V) as written
        self.tables = PageTables()  # decode steps' tables of sealed pages

    def plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> object:
        """A pass attends to pages sealed before it (quantized) and to everything it wrote or that is
        still in a tail page (full precision), like mlx-lm's quantized cache."""
        P, H, D = self.geom.page_size, self.geom.kv_heads, self.geom.head_dim
        p = np.array(pos, dtype=np.int32)
        n_before = p // P  # pages sealed before this pass
        if L > 1:
            if self.in_place and self.window_in_tails(L, pos, lens) and n_before.max() > 0:
                return self._multi_plan(rows, L, pos, lens)
            return self._prefill_plan(rows, L, p, lens)
        tails = [r.tail_slot for r in rows]
        tails_a = mx.array(tails, dtype=mx.int32)
        table_q = self.tables.table(rows, n_before.tolist()) if n_before.max() > 0 else None
        fill = p % P  # decode: one token per row into its tail; rows that fill their page seal it
        writes = tail_writes(P, H, self.store.k_axis, rows, pos, tails, fill.tolist())
        N = self.store.full_precision
        first = np.minimum(N, n_before * P)  # sealed first tokens, read from the dense copies
        use_first = table_q is not None and first.max() > 0
        if table_q is not None and self.in_place:
            t = quantized_paged_plan(table_q, n_before.tolist(), fill.tolist(), P, H, D, self.streams,
                                     first.tolist() if use_first else None, N)
            return QuantPagedDecode(tails_a, writes, t["q_page_heads"], t["query_of"], t["cuts"], t["mask_p"],
                                    use_first)
        mask_q = runs_q = mask_f = None
        if table_q is not None:
            width = table_q.shape[1]
            Tq = width * P
            mask_q = mx.arange(Tq)[None] < mx.array(n_before * P)[:, None]
            if use_first:
                f = mx.array(first)[:, None]
                mask_q = mask_q & (mx.arange(Tq)[None] >= f)
                mask_f = (mx.arange(N)[None] < f).reshape(len(rows), 1, 1, N)
            mask_q = mask_q.reshape(len(rows), 1, 1, Tq)
            # key scores in runs of pages, one per stream (see quantized_decode_attention)
            n = stream_split(len(rows) * H, Tq, D, min(len(self.streams), width))
            cuts = [width * i // n for i in range(n + 1)]
            runs_q = [table_q[:, a:z] for a, z in zip(cuts, cuts[1:])]
        mask_t = (mx.arange(P)[None] <= mx.array(fill)[:, None]).reshape(len(rows), 1, 1, P)
        mask_all = mx.concatenate([m for m in (mask_f, mask_q, mask_t) if m is not None], axis=-1)
        return QuantDecode(tails_a, table_q, writes, mask_q, runs_q, mask_t, mask_all, use_first)

    def window_in_tails(self, L: int, pos: list[int], lens: list[int]) -> bool:
        """Whether a pass of 2..multi_query tokens a row keeps each row's tokens in its tail page (a
        verification window always does: speculative/window.py), so it can be read like decode."""
        P = self.geom.page_size
        return 1 < L <= self.multi_query and all(a % P + n <= P for a, n in zip(pos, lens))

    def tail_plan(self, rows: list[CacheRow], pos: list[int], counts: Optional[list[int]],
                  streams: list) -> tuple[list[int], TailWrites, dict, bool]:
        """Reading the sealed pages in place, for one token a row (counts None) or counts[b] in row b's
        tail page: the rows' tail slots, the tail writes (a row that completes its page seals it), the
        `quantized_paged_plan` inputs and whether the rows' first-token copies are attended."""
        P, H, D = self.geom.page_size, self.geom.kv_heads, self.geom.head_dim
        n_before = [a // P for a in pos]
        fill = [a % P for a in pos]
        tails = [r.tail_slot for r in rows]
        writes = tail_writes(P, H, self.store.k_axis, rows, pos, tails, fill, counts)
        N = self.store.full_precision
        first = [min(N, n * P) for n in n_before]
        use_first = max(first) > 0
        t = quantized_paged_plan(page_table(rows, n_before), n_before, fill, P, H, D, streams,
                                 first if use_first else None, N, counts, self.geom.query_heads // H)
        return tails, writes, t, use_first

    def _multi_plan(self, rows: list[CacheRow], L: int, pos: list[int], lens: list[int]) -> QuantPagedDecode:
        """A few tokens a row, all in its tail page (a verification window): written into the tails as
        decode writes its token, and read in place like decode, each query over the sealed pages and
        the tail up to itself."""
        tails, writes, t, use_first = self.tail_plan(rows, pos, lens, self.streams)
        return QuantPagedDecode(mx.array(tails, dtype=mx.int32), writes, t["q_page_heads"], t["query_of"], t["cuts"],
                                t["mask_p"], use_first, real_tokens(L, lens))

    def _prefill_plan(self, rows: list[CacheRow], L: int, p: np.ndarray, lens: list[int]) -> QuantPrefill:
        P, H, B = self.geom.page_size, self.geom.kv_heads, len(rows)
        fill_np, lens_np = p.astype(np.int64) % P, np.asarray(lens, dtype=np.int64)
        sealed = (p // P).tolist()
        m = fill_np + lens_np  # each row's segment: its tail's earlier tokens, then its pass tokens
        S = int(m.max())
        base = B * P if fill_np.any() else 0  # where the pass's tokens start among the sources
        # Row b's segment position j comes from its tail page (b * P + j) below its fill, else from the pass
        # (base + b * L + j - fill); padding repeats the row's own first token (masked), never another row's.
        # Numpy over (B, S) at once: a pass holds up to B * S ~ 10^5 positions.
        b, j = np.arange(B)[:, None], np.arange(S)[None, :]
        f = fill_np[:, None]
        src = np.where(j < f, b * P + j, base + b * L + j - f)
        seg = np.where(j < m[:, None], src, src[:, :1])
        done = m // P * P  # the segment's tokens on pages the pass completes
        on_pages = j < done[:, None]
        kept = (j >= np.where(done > 0, done, fill_np)[:, None]) & (j < m[:, None])  # an open tail keeps its tokens
        page_src, tail_src = seg[on_pages], seg[kept]
        # the completed pages' pool slots: each row's pages from the one holding its first segment token
        n_pages = (sealed + done // P).tolist()
        table = page_array(rows, n_pages).astype(np.int64)
        tok = (p[:, None] - f) + j  # each segment position's position in its row
        page_slots = (table[b, np.minimum(tok // P, table.shape[1] - 1)] * P + tok % P)[on_pages]
        tail_slots = (np.asarray([r.tail_slot for r in rows], dtype=np.int64)[:, None] * P + j - done[:, None])[kept]
        arr = lambda x: mx.array(x.astype(np.int32)) if x.size else None  # noqa: E731
        n_q = max(sealed)
        i, t = mx.arange(L)[None, :, None], mx.arange(S)[None, None, :]
        f_a, n_a = mx.array(fill_np.astype(np.int32))[:, None, None], mx.array(lens)[:, None, None]
        mask = (t <= f_a + i) & (t < f_a + n_a)  # (B, L, S): a padding query sees the row's real tokens
        first = None
        if n_q:
            seen = mx.arange(n_q * P)[None, None, :] < (mx.array(sealed) * P)[:, None, None]
            mask = mx.concatenate([mx.broadcast_to(seen, (B, L, n_q * P)), mask], axis=-1)
            F = min(self.store.full_precision, n_q * P)
            if F:
                n_first = mx.minimum(mx.array(sealed) * P, F)
                first = (mx.arange(F)[None, :] < n_first[:, None]).reshape(B, 1, F, 1)
        return QuantPrefill(L, S, mx.array([r.tail_slot for r in rows], dtype=mx.int32), base > 0,
                            arr(seg.reshape(-1)) if base or S != L else None, arr(page_src), arr(page_slots),
                            arr(tail_src), arr(head_rows_array(tail_slots, P, H)),
                            page_table(rows, sealed) if n_q else None, mask.reshape(B, 1, L, -1), first)

    def write(self, layer: int, meta, keys: mx.array, values: mx.array) -> None:
        """Store the pass's K/V: a prefill pass's completed pages quantized and the rest into the tails (keeping each
        row's segment for its attention); decode tokens into tails (sealing the full ones)."""
        k, v = flat_tokens(keys, values)
        if isinstance(meta, QuantPrefill):
            st = self.store
            k, v = k.astype(st.dtype), v.astype(st.dtype)
            if meta.from_tails:  # the sources: the rows' tail pages' tokens, then the pass's
                B, P = meta.tails.shape[0], self.geom.page_size
                tk, tv = (buf[meta.tails].transpose(0, 2, 1, 3).reshape(B * P, *k.shape[1:])
                          for buf in (st.tk[layer], st.tv[layer]))
                k, v = mx.concatenate([tk, k]), mx.concatenate([tv, v])
            if meta.page_src is not None:
                assert meta.page_slots is not None  # built with page_src
                st.store_pages(layer, meta.page_slots, k[meta.page_src], v[meta.page_src])
            if meta.tail_src is not None:
                assert meta.tail_rows is not None  # built with tail_src
                st.write_tokens(layer, meta.tail_rows, k[meta.tail_src], v[meta.tail_src])
            if meta.seg is None:  # the pass's tokens are the segments: (B, H, L, D) as computed
                self._segment[layer] = (keys[:, :, :meta.S].astype(st.dtype), values[:, :, :meta.S].astype(st.dtype))
            else:
                B = meta.tails.shape[0]
                self._segment[layer] = tuple(x[meta.seg].reshape(B, meta.S, *x.shape[1:]).transpose(0, 2, 1, 3)
                                             for x in (k, v))
        else:
            take = getattr(meta, "take", None)  # a few-token pass read in place writes its real tokens only
            if take is not None:
                k, v = k[take], v[take]
            meta.writes.apply(self.store, layer, k, v)

    def attend(self, layer: int, meta, queries: mx.array, scale: float) -> mx.array:
        """Attention of the pass's queries over the rows' quantized pages and tails (and first-token copies)."""
        st = self.store
        k_transposed = st.k_axis == "channel"
        if isinstance(meta, QuantPagedDecode):
            tk, tv = st.gather_tails(layer, meta.tails)
            q = st.q[layer]
            return quantized_paged_decode(queries, q[:3], q[3:], tk, tv, meta.heads, meta.query_of, meta.mask_p,
                                          scale, st.group_size, (st.key_bits, st.value_bits), self.streams, meta.cuts,
                                          k_transposed=k_transposed,
                                          first=st.gather_first(layer, meta.tails) if meta.first else None)
        if isinstance(meta, QuantPrefill):
            return self._prefill_attend(layer, meta, queries, scale)
        tk, tv = st.gather_tails(layer, meta.tails)
        qk = qv = None
        if meta.table_q is not None:
            qk = []
            for i, run in enumerate(meta.runs_q):  # each run's gather on the stream that uses it
                if self.streams[i] is None:
                    qk.append(st.gather_quantized(layer, run, "k"))
                else:
                    with mx.stream(self.streams[i]):
                        qk.append(st.gather_quantized(layer, run, "k"))
            qv = st.gather_quantized(layer, meta.table_q, "v")
        return quantized_decode_attention(queries, qk, qv, tk, tv, meta.mask_q, meta.mask_t, scale, st.group_size,
                                          (st.key_bits, st.value_bits), self.streams, k_transposed=k_transposed,
                                          mask=meta.mask_all,
                                          first=st.gather_first(layer, meta.tails) if meta.first else None)

    def _prefill_attend(self, layer: int, meta: QuantPrefill, queries: mx.array, scale: float) -> mx.array:
        """Every row over its sealed pages, dequantized once for the pass (its sealed first tokens from the
        dense copy), and its segment as written; padded keys and queries masked."""
        st = self.store
        sk, sv = self._segment.pop(layer)
        if meta.table_q is not None:
            qk = st.gather_quantized(layer, meta.table_q)
            dk, dv = st.dequantize_k(*qk[:3]), st.dequantize_v(*qk[3:])
            if meta.first is not None:  # the sealed first tokens from the dense copy, not dequantized
                F = meta.first.shape[2]
                fk, fv = st.gather_first(layer, meta.tails)
                dk = mx.concatenate([mx.where(meta.first, fk[:, :, :F].astype(dk.dtype), dk[:, :, :F]), dk[:, :, F:]],
                                    axis=2)
                dv = mx.concatenate([mx.where(meta.first, fv[:, :, :F].astype(dv.dtype), dv[:, :, :F]), dv[:, :, F:]],
                                    axis=2)
            sk, sv = mx.concatenate([dk, sk], axis=2), mx.concatenate([dv, sv], axis=2)
        return dense_attention(queries, sk, sv, meta.mask, scale, upcast=self.upcast, composed=self.composed)

    def end(self) -> None:
        """Drop the prefill K/V kept for the pass's attention."""
        self._segment.clear()
