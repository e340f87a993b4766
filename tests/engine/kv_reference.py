"""Straightforward references for the paged cache, used only by tests.

`QuantRefCache` is mlx-lm's KVCache, except that the tokens of every page
completed before the current call are replaced by their quantize→dequantize
round trip: exactly what kvbatch stores, attended with plain full attention. Paging and batching must add no
error on top of it.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class QuantRefCache(KVCache):
    """k_axis="channel": keys are quantized per channel along each page's tokens (as
    QuantizedStore stores them then); values always per token."""

    def __init__(self, page_size: int, bits: int, group_size: int, k_axis: str = "token"):
        super().__init__()
        self.P, self.qbits, self.qgroup, self.k_axis = page_size, bits, group_size, k_axis

    def _rt(self, x: mx.array, n: int, by_channel: bool = False) -> mx.array:
        if n == 0:
            return x
        deq = round_trip(x[:, :, :n], self.P, self.qbits, self.qgroup, by_channel).astype(x.dtype)
        return mx.concatenate([deq, x[:, :, n:]], axis=2)

    def update_and_fetch(self, keys, values):
        sealed = (self.offset // self.P) * self.P  # pages completed before this call
        k, v = super().update_and_fetch(keys, values)
        return self._rt(k, sealed, self.k_axis == "channel"), self._rt(v, sealed)


def round_trip(x: mx.array, page_size: int, bits: int, group_size: int, by_channel: bool) -> mx.array:
    """quantize -> dequantize of x (..., T, D), T whole pages: along D (per token), or along
    each page's tokens (per channel)."""
    if not by_channel:
        return mx.dequantize(*mx.quantize(x, group_size=group_size, bits=bits), group_size=group_size, bits=bits)
    *lead, T, D = x.shape
    pages = x.reshape(*lead, T // page_size, page_size, D).swapaxes(-1, -2)  # (..., n, D, P)
    deq = mx.dequantize(*mx.quantize(pages, group_size=group_size, bits=bits), group_size=group_size, bits=bits)
    return deq.swapaxes(-1, -2).reshape(*lead, T, D)


def teacher_forced_logits(model, prompt: list[int], continuation: list[int], make_cache,
                          prefill_chunk: int = 1 << 30) -> list[mx.array]:
    """Single-stream logits for each generated step: the prompt (in chunks, as the engine
    prefills it: a chunk sees pages sealed before it quantized), then the continuation
    tokens one by one."""
    cache = make_cache()
    out = []
    for s in range(0, len(prompt), prefill_chunk):
        logits = model(mx.array([prompt[s:s + prefill_chunk]]), cache=cache)[0, -1]
    out.append(logits.astype(mx.float32))
    for t in continuation[:-1]:
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
        out.append(logits.astype(mx.float32))
        mx.eval(out[-1])
    return out


class StoredPagesRefCache(KVCache):
    """Reference that attends over the engine's *stored* quantized pages, dequantized.

    QuantRefCache re-quantizes keys that it computed itself; q8's 255 levels make a
    1e-7 difference in a key (a different but equally valid summation order in
    attention) flip a rounding step now and then, which the next layers turn into
    ~1e-4 logit differences. This reference removes that: for every page the
    engine sealed before the current call, it reads the engine's stored triplets
    (by the row's page table, with plain indexing) and dequantizes them; the rest
    it computes itself, in full precision. Paging and batching must then add no
    error at all beyond float rounding.

    rotation: a (D, D) orthogonal matrix the engine turned keys by before storing them
    (kv.rotate_keys): stored keys are turned back (k·H·Hᵀ = k) before attention.
    full_precision: the engine's first tokens read in full precision (kv.full_precision_tokens):
    the reference's own keys and values there instead of the stored pages.
    """

    def __init__(self, store, layer: int, pages: list[int], rotation=None, full_precision: int = 0):
        super().__init__()
        self.store, self.layer, self.pages = store, layer, pages
        self.P = store.page_size
        self.rotation, self.full_precision = rotation, full_precision

    def _stored(self, which: int, n_pages: int, dtype) -> mx.array:
        pages = mx.array(self.pages[:n_pages])
        # buffers are (pages, kv_heads, page_size, width) (K by channel: (pages, kv_heads, D, ·))
        w, s, b = (self.store.q[self.layer][which + j][pages] for j in range(3))
        bits = self.store.key_bits if which == 0 else self.store.value_bits
        deq = mx.dequantize(w, s, b, group_size=self.store.group_size, bits=bits)
        if which == 0 and getattr(self.store, "k_axis", "token") == "channel":
            deq = deq.swapaxes(-1, -2)  # K pages are stored transposed: (pages, kv_heads, D, P)
        n, H, P, D = deq.shape
        if which == 0 and self.rotation is not None:
            deq = deq.astype(mx.float32) @ self.rotation.T
        return deq.transpose(1, 0, 2, 3).reshape(1, H, n * P, D).astype(dtype)  # (1, Hkv, n*P, D)

    def update_and_fetch(self, keys, values):
        n_pages = self.offset // self.P  # pages sealed before this call
        k, v = super().update_and_fetch(keys, values)
        if n_pages:
            n = n_pages * self.P
            f = min(self.full_precision, n)
            k = mx.concatenate([k[:, :, :f], self._stored(0, n_pages, k.dtype)[:, :, f:], k[:, :, n:]], axis=2)
            v = mx.concatenate([v[:, :, :f], self._stored(3, n_pages, v.dtype)[:, :, f:], v[:, :, n:]], axis=2)
        return k, v


def record_page_tables(cache_manager) -> dict[str, list[int]]:
    """Keep each row's page table when the engine releases it (the data stays in the
    buffers until another row reuses those pages)."""
    tables: dict[str, list[int]] = {}
    release = cache_manager.release

    def keep(row, *args, **kw):
        tables[row.key] = list(row.pages)
        release(row, *args, **kw)

    cache_manager.release = keep
    return tables
