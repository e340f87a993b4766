"""The KV buffers themselves: per-layer page arrays, grown layer by layer.

Buffers are head-major pages, `(pages, kv_heads, page_size, width)` (quantized keys
may be stored transposed per page, see QuantizedStore), so a page table gathers
contiguous (row, head, tokens) blocks with one take, and CPU decode can read pages
in place. Callers address a token by slot (page * page_size + offset); writes go to
its head rows in the buffer seen as 2-D (`head_rows`, `scatter_rows`). Capacity is
always read from the live buffers' shapes.

Dense mode keeps K/V in the model dtype. Quantized modes (q8/q4/k8v4: keys and values
at their own bits) keep completed pages as mx.quantize triplets and the page each row
is still filling in full precision, in a small fixed "tail" buffer with one page per
batch slot; with kv.full_precision_tokens=N also a dense copy of each slot's first N tokens
(attention sinks: stored quantized as well, read from the copy).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np


def dequantize(w: mx.array, s: mx.array, b: mx.array, group_size: int, bits: int) -> mx.array:
    """Unpack one mx.quantize triplet (packed weights, scales, biases) to floats."""
    return mx.dequantize(w, s, b, group_size=group_size, bits=bits)


def _grow(a: mx.array, extra_slots: int) -> mx.array:
    pad = mx.zeros((extra_slots,) + a.shape[1:], dtype=a.dtype)
    out = mx.concatenate([a, pad], axis=0)
    mx.eval(out)
    return out


def head_rows(slots: list[int], page_size: int, kv_heads: int) -> list[int]:
    """Token slots (page * page_size + offset) -> the rows they occupy in a head-major buffer
    (pages, kv_heads, page_size, width) seen as (pages * kv_heads * page_size, width): one
    row per (slot, head), slot-major. Built on the host once per pass for every layer, as a
    list (numpy costs ~10 us an op on a few numbers right after a step's compute)."""
    return [((s // page_size) * kv_heads + h) * page_size + s % page_size for s in slots for h in range(kv_heads)]


def head_rows_array(slots: np.ndarray, page_size: int, kv_heads: int) -> np.ndarray:
    """head_rows of many slots at once (int32): a multi-token pass at a large batch has thousands."""
    s = np.asarray(slots, dtype=np.int64)[:, None]
    rows = ((s // page_size) * kv_heads + np.arange(kv_heads)) * page_size + s % page_size
    return rows.reshape(-1).astype(np.int32)


def scatter_rows(buf: mx.array, rows: mx.array, x: mx.array) -> mx.array:
    """buf with x (N, kv_heads, width) written into its head rows `rows` (see head_rows).

    One scatter with one index on a flat view: MLX builds `buf[page, :, off] = x` (two
    indices around a slice) from several ops, ~2x the CPU time of this (34 vs 17 us a
    write at tiny-llama decode shapes). MLX still updates buf's memory in place."""
    flat = buf.reshape(-1, buf.shape[-1])
    flat[rows] = x.reshape(-1, x.shape[-1])
    return flat.reshape(buf.shape)


class DenseStore:
    """K/V pages in the model dtype, laid out (pages, kv_heads, page_size, head_dim).

    Head-major pages make one gather produce attention's (B, kv_heads, T, head_dim)
    layout directly (contiguous), with no transpose copy: on the CPU backend a
    transposed K/V costs SDPA several times a contiguous one.
    """

    quantized = False

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: mx.Dtype):
        self.page_size, self.kv_heads, self.head_dim, self.dtype = page_size, kv_heads, head_dim, dtype
        empty = mx.zeros((0, kv_heads, page_size, head_dim), dtype=dtype)
        self.k = [empty] * num_layers
        self.v = [empty] * num_layers
        self._heads = mx.arange(kv_heads)[None, :, None]

    @property
    def capacity_pages(self) -> int:
        """Pages each layer's arrays hold now."""
        return self.k[0].shape[0]

    def layer_arrays(self, layer: int) -> list[mx.array]:
        """One layer's K and V page arrays."""
        return [self.k[layer], self.v[layer]]

    def all_arrays(self) -> list[mx.array]:
        """Every layer's K and V page arrays."""
        return self.k + self.v

    @property
    def nbytes(self) -> int:
        """Bytes of every page array."""
        return sum(a.nbytes for a in self.all_arrays())

    def grow(self, new_pages: int) -> None:
        """One layer at a time, so the transient copy is one layer's buffer, not the pool."""
        extra = new_pages - self.capacity_pages
        for i in range(len(self.k)):
            self.k[i] = _grow(self.k[i], extra)
            self.v[i] = _grow(self.v[i], extra)

    def write(self, layer: int, rows: mx.array, k: mx.array, v: mx.array) -> None:
        """k, v: (N, kv_heads, head_dim) into head rows `rows` (N * kv_heads, see head_rows)."""
        self.k[layer] = scatter_rows(self.k[layer], rows, k.astype(self.dtype))
        self.v[layer] = scatter_rows(self.v[layer], rows, v.astype(self.dtype))

    def clear_pages(self, pages: list[int]) -> None:
        """Zero these pages in every layer (a row that ended non-finite leaves no NaN behind:
        masked slots still meet attention's probs @ V, and 0 * NaN is NaN)."""
        idx = mx.array(pages, dtype=mx.int32)
        for i in range(len(self.k)):
            self.k[i][idx] = 0
            self.v[i][idx] = 0
        mx.eval(self.k, self.v)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Pages dst become copies of pages src, in every layer (copy on write of a forked row's
        partly filled page)."""
        s, d = mx.array(src, dtype=mx.int32), mx.array(dst, dtype=mx.int32)
        for i in range(len(self.k)):
            self.k[i][d] = self.k[i][s]
            self.v[i][d] = self.v[i][s]

    def gather(self, layer: int, table: mx.array) -> tuple[mx.array, mx.array]:
        """table (B, max_pages) -> K, V as (B, kv_heads, max_pages*page_size, head_dim), contiguous."""
        return self._take(self.k[layer], table), self._take(self.v[layer], table)

    def _take(self, buf: mx.array, table: mx.array) -> mx.array:
        B, n = table.shape
        pages = buf[table[:, None, :], self._heads]  # (B, kv_heads, n, page_size, head_dim)
        return pages.reshape(B, self.kv_heads, n * self.page_size, self.head_dim)


class QuantizedStore:
    """Completed pages quantized (affine, mx.quantize); the filling page dense.

    V pages are head-major, (pages, kv_heads, page_size, width), quantized per token
    (groups along head_dim), like DenseStore, so a page-table gather yields
    contiguous (B, kv_heads, T, width) triplets. K pages are the same by default
    ("token" axis); with `k_axis="channel"` (page_size a multiple of group_size) each
    K page is stored transposed, (pages, kv_heads, head_dim, page_size·bits/32),
    quantized per channel along the page's tokens. Two reasons: keys have outlier
    channels, and per-channel groups keep them from inflating every token's scale
    (KIVI, arXiv:2402.02750); and the scores then run as `quantized_matmul(q, K^T,
    transpose=False)`, which MLX's CPU backend runs 2.5-4x faster than the
    transposed form (docs/performance.md). Tails (one dense page per
    batch slot) are (slots, kv_heads, page_size, head_dim).
    """

    quantized = True

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: mx.Dtype,
                 bits: int | tuple[int, int], group_size: int, tail_slots: int, k_axis: str = "token",
                 full_precision: int = 0):
        """bits: of keys and values alike, or (key bits, value bits); full_precision: tokens at the start
        of each row also kept dense, per tail slot (fk / fv: (slots, kv_heads, N, head_dim))."""
        if k_axis not in ("token", "channel"):
            raise ValueError(f"k_axis must be 'token' or 'channel', not {k_axis!r}")
        if k_axis == "channel" and page_size % group_size:
            raise ValueError(f"per-channel keys need page_size ({page_size}) to be a multiple of "
                             f"group_size ({group_size})")
        self.page_size, self.kv_heads, self.head_dim, self.dtype = page_size, kv_heads, head_dim, dtype
        self.key_bits, self.value_bits = (bits, bits) if isinstance(bits, int) else tuple(bits)
        self.group_size, self.k_axis = group_size, k_axis
        groups = head_dim // group_size

        def empty(width, dt, rows=page_size):
            return mx.zeros((0, kv_heads, rows, width), dtype=dt)

        def k_empty():
            kb = self.key_bits
            if k_axis == "token":
                return [empty(head_dim * kb // 32, mx.uint32), empty(groups, dtype), empty(groups, dtype)]
            tp, tg = page_size * kb // 32, page_size // group_size
            return [empty(tp, mx.uint32, head_dim), empty(tg, dtype, head_dim), empty(tg, dtype, head_dim)]

        v_packed = head_dim * self.value_bits // 32
        # per layer: [k_w, k_scales, k_biases, v_w, v_scales, v_biases]
        self.q = [k_empty() + [empty(v_packed, mx.uint32), empty(groups, dtype), empty(groups, dtype)]
                  for _ in range(num_layers)]
        tail_shape = (tail_slots, kv_heads, page_size, head_dim)
        self.tk = [mx.zeros(tail_shape, dtype=dtype) for _ in range(num_layers)]
        self.tv = [mx.zeros(tail_shape, dtype=dtype) for _ in range(num_layers)]
        self.full_precision = full_precision
        fp_shape = (tail_slots, kv_heads, full_precision, head_dim)
        self.fk = [mx.zeros(fp_shape, dtype=dtype) for _ in range(num_layers)] if full_precision else []
        self.fv = [mx.zeros(fp_shape, dtype=dtype) for _ in range(num_layers)] if full_precision else []
        self._heads = mx.arange(kv_heads)[None, :, None]
        mx.eval(self.tk, self.tv, self.fk, self.fv)

    def _quantize(self, x: mx.array, keys: bool) -> tuple[mx.array, mx.array, mx.array]:
        return mx.quantize(x, group_size=self.group_size, bits=self.key_bits if keys else self.value_bits)

    @property
    def capacity_pages(self) -> int:
        """Packed pages each layer's arrays hold now."""
        return self.q[0][0].shape[0]

    def layer_arrays(self, layer: int) -> list[mx.array]:
        """One layer's packed page triplets and its tail pages."""
        return self.q[layer] + [self.tk[layer], self.tv[layer]]

    def all_arrays(self) -> list[mx.array]:
        """Every array the store holds: packed pages, tails and first-token copies."""
        return [a for arrs in self.q for a in arrs] + self.tk + self.tv + self.fk + self.fv

    @property
    def nbytes(self) -> int:
        """Bytes of the packed pages (the dense slots are `tail_nbytes`)."""
        return sum(a.nbytes for arrs in self.q for a in arrs)

    @property
    def tail_nbytes(self) -> int:
        """The dense slots: tail pages and first-token copies (memory.KVLayout.slot_bytes per slot)."""
        return sum(a.nbytes for a in self.tk + self.tv + self.fk + self.fv)

    def grow(self, new_pages: int) -> None:
        """Grow every layer's packed pages to `new_pages` (the tails keep their size)."""
        extra = new_pages - self.capacity_pages
        for arrs in self.q:
            arrs[:] = [_grow(a, extra) for a in arrs]

    def store_pages(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Quantize whole pages of full-precision tokens (N, kv_heads, head_dim) into their
        slots (page*P + offset; each page's P tokens consecutive and in order)."""
        arrs = self.q[layer]
        P = self.page_size
        page, off = slots // P, slots % P
        vq = self._quantize(v, keys=False)
        for i, a in enumerate(vq):
            arrs[3 + i][page, :, off] = a.astype(arrs[3 + i].dtype)
        if self.k_axis == "token":
            kq = self._quantize(k, keys=True)
            for i, a in enumerate(kq):
                arrs[i][page, :, off] = a.astype(arrs[i].dtype)
            return
        n = k.shape[0] // P
        kt = k.reshape(n, P, self.kv_heads, self.head_dim).transpose(0, 2, 3, 1)  # (n, H, D, P)
        kq = self._quantize(kt, keys=True)
        pages = page.reshape(n, P)[:, 0]
        for i, a in enumerate(kq):
            arrs[i][pages] = a.astype(arrs[i].dtype)

    def _tail_tokens(self, buf: mx.array, slots: mx.array) -> mx.array:
        """Tail tokens by tail slot (tail*P + offset) -> (N, kv_heads, head_dim)."""
        return buf[slots // self.page_size, :, slots % self.page_size]

    def clear_pages(self, pages: list[int]) -> None:
        """Zero these pages in every layer (see DenseStore.clear_pages)."""
        idx = mx.array(pages, dtype=mx.int32)
        for arrs in self.q:
            for a in arrs:
                a[idx] = 0
        mx.eval([a for arrs in self.q for a in arrs])

    def clear_tail(self, tail: int) -> None:
        """Zero one tail page (and its first-token copy) in every layer."""
        for i in range(len(self.tk)):
            self.tk[i][tail] = 0
            self.tv[i][tail] = 0
            if self.full_precision:
                self.fk[i][tail] = 0
                self.fv[i][tail] = 0
        mx.eval(self.tk, self.tv, self.fk, self.fv)

    def copy_tail(self, src: int, dst: int) -> None:
        """Tail page dst becomes a copy of tail page src, in every layer (copy on write of a forked
        row's partly filled page: in q8/q4 it is kept dense, in its tail)."""
        for i in range(len(self.tk)):
            self.tk[i][dst] = self.tk[i][src]
            self.tv[i][dst] = self.tv[i][src]

    def copy_first(self, src: int, dst: int) -> None:
        """Slot dst's first-token copy becomes slot src's (a forked row continues from src's tokens)."""
        for i in range(len(self.fk)):
            self.fk[i][dst] = self.fk[i][src]
            self.fv[i][dst] = self.fv[i][src]

    def write_first(self, layer: int, rows: mx.array, k: mx.array, v: mx.array) -> None:
        """Tokens at positions < full_precision into their slots' dense copy. k, v: (N, kv_heads,
        head_dim); rows: head_rows of (tail * full_precision + position) with page size full_precision."""
        self.fk[layer] = scatter_rows(self.fk[layer], rows, k.astype(self.dtype))
        self.fv[layer] = scatter_rows(self.fv[layer], rows, v.astype(self.dtype))

    def gather_first(self, layer: int, tails: mx.array) -> tuple[mx.array, mx.array]:
        """The rows' first-token copies: (B, kv_heads, full_precision, head_dim) each."""
        return self.fk[layer][tails], self.fv[layer][tails]

    def write_tokens(self, layer: int, tail_rows: mx.array, k: mx.array, v: mx.array) -> None:
        """One new token per row into its tail page (decode). k, v: (B, kv_heads, head_dim);
        tail_rows: head_rows of the tail slots (tail * page_size + offset)."""
        self.tk[layer] = scatter_rows(self.tk[layer], tail_rows, k.astype(self.dtype))
        self.tv[layer] = scatter_rows(self.tv[layer], tail_rows, v.astype(self.dtype))

    def seal_tails(self, layer: int, tail_slots: mx.array, page_slots: mx.array) -> None:
        """Quantize whole tail pages (token slots tail_slots) into pool token slots page_slots."""
        self.store_pages(layer, page_slots, self._tail_tokens(self.tk[layer], tail_slots),
                          self._tail_tokens(self.tv[layer], tail_slots))

    def seal_tail_pages(self, layer: int, tails: mx.array, pages: mx.array) -> None:
        """seal_tails by whole pages (routes/common.py tail_writes): tail pages `tails`, quantized, into
        pool pages `pages`. Keys stored per token only: K's pools then have the values' layout,
        (pages, kv_heads, page_size, width), so a tail page maps onto a pool page as it is."""
        arrs = self.q[layer]
        for j, buf in ((0, self.tk[layer]), (3, self.tv[layer])):
            # (N, kv_heads, page_size, head_dim): quantize groups the last axis only
            for i, a in enumerate(self._quantize(buf[tails], keys=j == 0)):
                arrs[j + i][pages] = a.astype(arrs[j + i].dtype)

    def write_run(self, layer: int, tail: int, fill: int, page_slots: mx.array | None,
                  k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """A run of L tokens for one row (prefill): completes pages, keeps the rest in its tail.

        fill: tokens already in the row's tail page; page_slots: pool slots of the
        pages this run completes (None if none). k, v: (L, kv_heads, head_dim).
        Returns the run's full-precision segment (fill + L tokens): the pass that
        wrote it attends to it unquantized, as mlx-lm's prefill does.
        """
        P = self.page_size
        if fill:
            k = mx.concatenate([self.tk[layer][tail, :, :fill].swapaxes(0, 1), k.astype(self.dtype)])
            v = mx.concatenate([self.tv[layer][tail, :, :fill].swapaxes(0, 1), v.astype(self.dtype)])
        n_done = (k.shape[0] // P) * P
        if n_done:
            assert page_slots is not None  # the run completes pages: the caller gave their slots
            self.store_pages(layer, page_slots, k[:n_done], v[:n_done])
        rest = k.shape[0] - n_done
        if rest:
            self.tk[layer][tail, :, :rest] = k[n_done:].swapaxes(0, 1).astype(self.dtype)
            self.tv[layer][tail, :, :rest] = v[n_done:].swapaxes(0, 1).astype(self.dtype)
        return k, v

    def gather_quantized(self, layer: int, table: mx.array, which: str = "kv") -> list[mx.array]:
        """Quantized K/V triplets of the pages in table, contiguous (which="k" or "v": only that
        triplet). V, and K by token: (B, kv_heads, T, width). K by channel: K^T, (B, kv_heads,
        head_dim, T·bits/32 or T/group_size)."""
        B, n = table.shape
        out = []
        arrs = self.q[layer]
        for i, a in enumerate(arrs):
            if (which == "k" and i >= 3) or (which == "v" and i < 3):
                continue
            pages = a[table[:, None, :], self._heads]  # (B, kv_heads, n, rows, width)
            if i < 3 and self.k_axis == "channel":
                out.append(pages.transpose(0, 1, 3, 2, 4).reshape(B, self.kv_heads, self.head_dim,
                                                                   n * a.shape[-1]))
            else:
                out.append(pages.reshape(B, self.kv_heads, n * a.shape[2], a.shape[-1]))
        return out

    def dequantize_k(self, w: mx.array, s: mx.array, b: mx.array) -> mx.array:
        """Gathered K triplets -> (B, kv_heads, T, head_dim) in full precision."""
        k = dequantize(w, s, b, self.group_size, self.key_bits)
        return k.swapaxes(-1, -2) if self.k_axis == "channel" else k

    def dequantize_v(self, w: mx.array, s: mx.array, b: mx.array) -> mx.array:
        """Gathered V triplets -> (B, kv_heads, T, head_dim) in full precision."""
        return dequantize(w, s, b, self.group_size, self.value_bits)

    def gather_tails(self, layer: int, tails: mx.array) -> tuple[mx.array, mx.array]:
        """Tail pages of the rows: (B, kv_heads, page_size, head_dim) each."""
        return self.tk[layer][tails], self.tv[layer][tails]
