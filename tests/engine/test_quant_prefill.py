"""q8/q4 prefill passes take every row together (routes/quant.py QuantRoute._prefill_plan): rows starting their
prompt, rows continuing it mid-page or at a page boundary, rows whose chunk completes pages, right-padded to the
longest and masked. A pass of such rows must write the same packed pages, tails and outputs as the same rows
prefilled one row a pass, and its outputs must be attention over the row's earlier tokens quantized (dense for
its first-token copies) and its tail and chunk at full precision."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.routes.base import Geometry
from kvbatch.engine.kv.routes.quant import QuantPrefill, QuantRoute
from kvbatch.engine.kv.store import QuantizedStore, dequantize

P, HKV, G, D, L = 32, 2, 2, 64, 9
POS = [0, P + 3, 2 * P, 3 * P - 2, 5]  # fresh; mid-page; at a boundary; completes a page; first page, no seal
LENS = [L, 5, L, 4, 2]


def _route(bits: int, k_axis: str, first: int) -> tuple[QuantRoute, QuantizedStore, list[CacheRow]]:
    store = QuantizedStore(1, HKV, D, P, mx.float32, bits, 32, tail_slots=len(POS), k_axis=k_axis,
                           full_precision=first)
    store.grow(40)
    route = QuantRoute(store, Geometry(P, HKV, D, HKV * G), [None], in_place=False)
    rows = [CacheRow(f"r{i}", pages=[8 * i + j for j in range(8)][::-1], tail=i) for i in range(len(POS))]
    return route, store, rows


def _pass(route: QuantRoute, rows, pos, lens, q, k, v, first: int, store: QuantizedStore) -> mx.array:
    meta = route.plan(rows, q.shape[2], pos, lens)
    assert isinstance(meta, QuantPrefill)
    if first:  # the cache writes the first-token copies before the route (kv/cache.py)
        for b, (a, n) in enumerate(zip(pos, lens)):
            for i in range(n):
                if a + i < first:
                    store.fk[0][rows[b].tail, :, a + i] = k[b, :, i]
                    store.fv[0][rows[b].tail, :, a + i] = v[b, :, i]
    route.write(0, meta, k, v)
    out = route.attend(0, meta, q, D ** -0.5)
    route.end()
    for r, a, n in zip(rows, pos, lens):
        r.length = a + n
    mx.eval(out)
    return out


def _prefixes(rng, route, store, rows, first):
    """Each row's tokens before the pass, one prefill pass a row; returns them (K, V: (H, pos, D))."""
    pre = []
    for r, a in zip(rows, POS):
        pk = rng.standard_normal((1, HKV, max(a, 1), D)).astype(np.float32)
        pv = rng.standard_normal((1, HKV, max(a, 1), D)).astype(np.float32)
        if a:
            _pass(route, [r], [0], [a], mx.zeros((1, HKV * G, a, D)), mx.array(pk), mx.array(pv), first, store)
        pre.append((pk[0, :, :a], pv[0, :, :a]))
    return pre


def _buffers(store: QuantizedStore, pos, lens) -> list[mx.array]:
    ends = [a + n for a, n in zip(pos, lens)]
    return store.q[0] + [t[i, :, :e % P] for t in (store.tk[0], store.tv[0]) for i, e in enumerate(ends)] + \
        ([store.fk[0], store.fv[0]] if store.full_precision else [])


@pytest.mark.parametrize("bits,k_axis,first", [(8, "token", 0), (4, "channel", 0), (8, "token", 5)])
def test_one_pass_of_every_row_equals_a_row_a_pass(bits, k_axis, first):
    rng = np.random.default_rng(bits + first)
    q = mx.array(rng.standard_normal((len(POS), HKV * G, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((len(POS), HKV, L, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((len(POS), HKV, L, D)).astype(np.float32))
    outs, bufs = [], []
    for together in (True, False):
        route, store, rows = _route(bits, k_axis, first)
        pre = _prefixes(np.random.default_rng(7), route, store, rows, first)
        if together:
            out = _pass(route, rows, POS, LENS, q, k, v, first, store)
        else:
            out = mx.concatenate([mx.pad(_pass(route, [r], [a], [n], q[b:b + 1, :, :n], k[b:b + 1, :, :n],
                                               v[b:b + 1, :, :n], first, store), [(0, 0), (0, 0), (0, L - n), (0, 0)])
                                  for b, (r, a, n) in enumerate(zip(rows, POS, LENS))])
        outs.append(out)
        bufs.append(_buffers(store, POS, LENS))
    for x, y in zip(*bufs):
        assert mx.array_equal(x, y).item()
    for b, n in enumerate(LENS):
        assert mx.allclose(outs[0][b, :, :n], outs[1][b, :, :n], atol=1e-5).item(), b
    # against the meaning: each real query over the row's sealed tokens as stored quantized (the first `first`
    # dense), the rest of its tokens and its chunk at full precision, causally
    for b, (a, n) in enumerate(zip(POS, LENS)):
        pk, pv = pre[b]
        sealed = a // P * P
        keys = np.concatenate([pk, np.array(k[b, :, :n])], axis=1)
        vals = np.concatenate([pv, np.array(v[b, :, :n])], axis=1)
        if sealed:
            kq = np.array(dequantize(*mx.quantize(mx.array(pk[:, :sealed]), group_size=32, bits=bits), 32, bits)) \
                if k_axis == "token" else np.swapaxes(np.array(dequantize(*mx.quantize(
                    mx.array(np.swapaxes(pk[:, :sealed].reshape(HKV, sealed // P, P, D), -1, -2)), group_size=32,
                    bits=bits), 32, bits)), -1, -2).reshape(HKV, sealed, D)
            vq = np.array(dequantize(*mx.quantize(mx.array(pv[:, :sealed]), group_size=32, bits=bits), 32, bits))
            keep = min(first, sealed)
            keys[:, keep:sealed], vals[:, keep:sealed] = kq[:, keep:], vq[:, keep:]
        for h in range(HKV * G):
            for i in range(n):
                s = keys[h // G, :a + i + 1] @ np.array(q[b, h, i]) * D ** -0.5
                w = np.exp(s - s.max())
                want = (w / w.sum()) @ vals[h // G, :a + i + 1]
                np.testing.assert_allclose(np.array(outs[0][b, h, i]), want, rtol=2e-4, atol=2e-4)
