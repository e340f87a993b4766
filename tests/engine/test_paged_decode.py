"""CPU decode attention read from the pages in place against the gathered path: float32 pages
(`paged_grouped_decode` vs `_grouped_decode` on K/V copied out by the page table) and q8/q4
packed pages (`quantized_paged_decode` vs `quantized_decode_attention`)."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvbatch.engine.kv.routes.dense import _grouped_decode, paged_grouped_decode
from kvbatch.engine.kv.routes.quant import quantized_decode_attention, quantized_paged_decode, quantized_paged_plan
from kvbatch.engine.kv.store import QuantizedStore


@pytest.mark.parametrize("B,Hkv,G,D,P", [(1, 1, 1, 64, 16), (5, 2, 2, 64, 16), (3, 3, 3, 64, 64),
                                         (4, 2, 4, 128, 32)])
def test_in_place_decode_equals_gathered(B, Hkv, G, D, P):
    rng = np.random.default_rng(B * 100 + P)
    n_pages = 3 * B + 4
    k_pages = mx.array(rng.standard_normal((n_pages, Hkv, P, D)).astype(np.float32))
    v_pages = mx.array(rng.standard_normal((n_pages, Hkv, P, D)).astype(np.float32))
    lengths = [P * 2 + 5 - i for i in range(B)]  # rows of different lengths, in 2-3 pages
    width = max(-(-n // P) for n in lengths)
    order = rng.permutation(n_pages).tolist()
    table = []
    for n in lengths:  # each row's own pages, padded with its first page (masked), as the cache does
        own = [order.pop() for _ in range(-(-n // P))]
        table.append(own + [own[0]] * (width - len(own)))
    table = mx.array(table, dtype=mx.int32)
    mask = (mx.arange(width * P)[None] < mx.array(lengths)[:, None]).reshape(B, 1, 1, width * P)
    q = mx.array(rng.standard_normal((B, Hkv * G, 1, D)).astype(np.float32))
    scale = D ** -0.5

    heads = mx.arange(Hkv)[None, :, None]
    k = k_pages[table[:, None, :], heads].reshape(B, Hkv, width * P, D)
    v = v_pages[table[:, None, :], heads].reshape(B, Hkv, width * P, D)
    want = _grouped_decode(q, k, v, mask, scale)
    page_heads = (table[:, None, :] * Hkv + heads).astype(mx.uint32)
    query_of = mx.arange(B * Hkv, dtype=mx.uint32).reshape(B, Hkv, 1)
    key_mask = mask.reshape(B, 1, -1, 1)  # key-major, as the cache plans it
    got = paged_grouped_decode(q, k_pages, v_pages, page_heads, query_of, key_mask, scale)
    assert got.shape == want.shape == (B, Hkv * G, 1, D)
    assert mx.abs(got - want).max().item() < 1e-5
    # a masked slot does not count: changing K/V past a row's length leaves its output alone
    row0_last = table[0, (lengths[0] - 1) // P].item()
    if lengths[0] % P:  # the row's last page has slots past its length: poison them
        k3 = np.array(k_pages)
        k3[row0_last, :, lengths[0] % P:] = 1e4
        got3 = paged_grouped_decode(q, mx.array(k3), v_pages, page_heads, query_of, key_mask, scale)
        assert mx.abs(got3[0] - got[0]).max().item() < 1e-5


@pytest.mark.parametrize("B,Hkv,G,D,P,group,bits,k_axis,split",
                         [(1, 1, 1, 64, 16, 64, 8, "token", 1), (5, 2, 2, 64, 16, 32, 4, "token", 2),
                          (3, 3, 3, 64, 64, 64, 8, "channel", 1), (4, 2, 4, 128, 64, 32, 4, "channel", 3)])
def test_quantized_in_place_decode_equals_gathered(B, Hkv, G, D, P, group, bits, k_axis, split):
    """q8/q4 decode over packed pages read in place (`quantized_paged_decode`, gather_qmm) against
    the same pages gathered (`quantized_decode_attention`): rows of different lengths (sealed
    pages and tail fill), tables padded with the row's own first page, work split over streams."""
    rng = np.random.default_rng(B * 100 + P + bits)
    n_pages = 4 * B + 3
    st = QuantizedStore(1, Hkv, D, P, mx.float32, bits, group, tail_slots=B + 2, k_axis=k_axis)
    st.grow(n_pages)
    st.store_pages(0, mx.arange(n_pages * P, dtype=mx.int32),
                    mx.array(rng.standard_normal((n_pages * P, Hkv, D)).astype(np.float32)),
                    mx.array(rng.standard_normal((n_pages * P, Hkv, D)).astype(np.float32)))
    st.tk[0] = mx.array(rng.standard_normal(st.tk[0].shape).astype(np.float32))
    st.tv[0] = mx.array(rng.standard_normal(st.tv[0].shape).astype(np.float32))
    sealed = [3 - i % 3 for i in range(B)]  # 3, 2, 1, 3, ... sealed pages
    fill = [(7 * i + 1) % P or 1 for i in range(B)]  # tokens in the tail page (>= 1: the new one)
    width = max(sealed)
    order = rng.permutation(n_pages).tolist()
    table = []
    for n in sealed:
        own = [order.pop() for _ in range(n)]
        table.append(own + [own[0]] * (width - n))
    table = mx.array(table, dtype=mx.int32)
    tails = mx.array(rng.permutation(B + 2)[:B].astype(np.int32))
    q = mx.array(rng.standard_normal((B, Hkv * G, 1, D)).astype(np.float32))
    scale = D ** -0.5
    streams = [None] + [mx.new_stream(mx.cpu) for _ in range(split - 1)]
    cuts = [width * i // split for i in range(split + 1)]

    tk, tv = st.gather_tails(0, tails)
    mask_q = (mx.arange(width * P)[None] < mx.array(sealed)[:, None] * P).reshape(B, 1, 1, width * P)
    mask_t = (mx.arange(P)[None] < mx.array(fill)[:, None]).reshape(B, 1, 1, P)
    want = quantized_decode_attention(q, st.gather_quantized(0, table, "k"), st.gather_quantized(0, table, "v"), tk,
                                      tv, mask_q, mask_t, scale, group, bits, k_transposed=k_axis == "channel")
    heads = mx.arange(Hkv)[None, :, None]
    plan = quantized_paged_plan(table, sealed, [f - 1 for f in fill], P, Hkv, D, streams)  # as the cache does
    page_heads, query_of, mask = plan["q_page_heads"], plan["query_of"], plan["mask_p"]

    got = quantized_paged_decode(q, st.q[0][:3], st.q[0][3:], tk, tv, page_heads, query_of, mask, scale, group,
                                 bits, streams, cuts, k_transposed=k_axis == "channel")
    assert got.shape == want.shape == (B, Hkv * G, 1, D)
    assert mx.abs(got - want).max().item() < 1e-5
    # one stream gives exactly the same output as the split
    one = quantized_paged_decode(q, st.q[0][:3], st.q[0][3:], tk, tv, page_heads, query_of, mask, scale, group,
                                 bits, k_transposed=k_axis == "channel")
    assert mx.array_equal(one, got).item()
    # masked slots do not count: the tail past its fill, and the padding of a table (here a page
    # no row holds, with huge keys and values) add exact zeros
    tk2 = np.array(tk)
    for b in range(B):
        tk2[b, :, fill[b]:] = 1e4
    spare = order[0]
    arrs = [np.array(a) for a in st.q[0]]
    arrs[1][spare] = 1e4  # key scales
    arrs[4][spare] = 1e4  # value scales
    pad = mx.array([row[:n] + [spare] * (width - n) for row, n in zip(table.tolist(), sealed)], dtype=mx.int32)
    ph2 = (pad[:, None, :] * Hkv + heads).astype(mx.uint32)
    q2 = [mx.array(a) for a in arrs]
    got2 = quantized_paged_decode(q, q2[:3], q2[3:], mx.array(tk2), tv, ph2, query_of, mask, scale, group, bits,
                                  streams, cuts, k_transposed=k_axis == "channel")
    assert mx.array_equal(got2, got).item()


@pytest.mark.parametrize("route", ["cpu", "portable"])
@pytest.mark.parametrize("P,G", [(16, 2), (64, 3)])
def test_few_token_pass_in_place_equals_gathered(P, G, route):
    """A verification window (a few tokens a row, ragged, one row crossing into a new page) attended
    in place like decode, each query over its own keys (the CPU route's DenseRoute.multi_plan, the
    portable route's PortableDenseRoute.plan), against the same pass gathered and masked causally (the
    prefill plan): the same pages written, the same outputs."""
    from kvbatch.engine.kv.pages import CacheRow
    from kvbatch.engine.kv.routes.base import Geometry
    from kvbatch.engine.kv.routes.dense import DenseRoute, DenseStep
    from kvbatch.engine.kv.routes.portable import PortableDenseRoute, PortableStep
    from kvbatch.engine.kv.store import DenseStore

    Hkv, D, L = 2, 64, 5
    pos, lens = [3, P - 2, 3 * P + 7], [5, 4, 1]
    n_pages = [-(-(a + n) // P) for a, n in zip(pos, lens)]
    rng = np.random.default_rng(P)
    q, k, v = (mx.array(rng.standard_normal((3, h, L, D)).astype(np.float32)) for h in (Hkv * G, Hkv, Hkv))
    outs, pools = [], []
    for in_place in (True, False):
        store = DenseStore(1, Hkv, D, P, mx.float32)
        store.grow(sum(n_pages) + 1)
        store.k[0] = mx.array(rng.standard_normal(store.k[0].shape).astype(np.float32)) if not pools else pools[0][2]
        store.v[0] = mx.array(rng.standard_normal(store.v[0].shape).astype(np.float32)) if not pools else pools[0][3]
        before = (store.k[0], store.v[0])
        rows, first = [], 1
        for i, n in enumerate(n_pages):  # pages out of order, none shared
            rows.append(CacheRow(f"r{i}", pages=list(range(first + n - 1, first - 1, -1)), length=pos[i]))
            first += n
        geom = Geometry(P, Hkv, D, Hkv * G)
        portable = in_place and route == "portable"
        r: DenseRoute = (PortableDenseRoute(store, geom, upcast=False, multi_query=8) if portable
                         else DenseRoute(store, geom, upcast=False, cpu=True, in_place=in_place, multi_query=8))
        meta = r.plan(rows, L, pos, lens)
        if route == "portable" and in_place:
            assert isinstance(meta, PortableStep) and meta.take is not None
        else:
            assert isinstance(meta, DenseStep) and bool(meta.groups) == in_place
        r.write(0, meta, k, v)
        outs.append(r.attend(0, meta, q, D ** -0.5))
        pools.append((store.k[0], store.v[0], *before))
    assert mx.array_equal(pools[0][0], pools[1][0]).item() and mx.array_equal(pools[0][1], pools[1][1]).item()
    for b, n in enumerate(lens):
        assert mx.allclose(outs[0][b, :, :n], outs[1][b, :, :n], atol=2e-5).item(), b


@pytest.mark.parametrize("k_axis,bits,route,first", [("channel", 8, "cpu", 0), ("token", 4, "cpu", 0),
                                                     ("token", 8, "portable", 0), ("token", 4, "portable", 40)])
def test_few_token_quantized_pass_in_place_equals_gathered(k_axis, bits, route, first):
    """q8/q4 (float32 stores): a verification window in each row's tail page (one row's one token
    completing its page, which it seals) read in place like decode (the CPU route's
    QuantRoute._multi_plan, the portable route's PortableQuantRoute.plan; with `first`, the rows'
    first tokens read from their dense copies), against the prefill path (sealed pages dequantized,
    the chunk as written): the same buffers after the pass, the same outputs within float32
    rounding of the quantized products."""
    from kvbatch.engine.kv.pages import CacheRow
    from kvbatch.engine.kv.routes.base import Geometry
    from kvbatch.engine.kv.routes.portable import PortableQuantRoute, PortableQuantStep
    from kvbatch.engine.kv.routes.quant import QuantPagedDecode, QuantPrefill, QuantRoute

    P, Hkv, G, D, L = 32, 2, 3, 64, 4
    pos, lens = [P + 3, 3 * P - 1, 2 * P + 9], [4, 1, 3]  # row 1's own token completes its third page
    rng = np.random.default_rng(bits)
    prefix = [(mx.array(rng.standard_normal((1, Hkv, a, D)).astype(np.float32)),
               mx.array(rng.standard_normal((1, Hkv, a, D)).astype(np.float32))) for a in pos]
    q, k, v = (mx.array(rng.standard_normal((3, h, L, D)).astype(np.float32)) for h in (Hkv * G, Hkv, Hkv))
    outs, bufs = [], []
    for in_place in (True, False):
        store = QuantizedStore(1, Hkv, D, P, mx.float32, bits, 32, tail_slots=3, k_axis=k_axis, full_precision=first)
        store.grow(12)
        geom = Geometry(P, Hkv, D, Hkv * G)
        r = (PortableQuantRoute(store, geom, multi_query=8) if in_place and route == "portable" else
             QuantRoute(store, geom, [None], in_place=in_place, multi_query=8))
        rows = [CacheRow(f"r{i}", pages=[3 * i + j for j in range(3)][::-1] + [9 + i], tail=i) for i in range(3)]
        for row, a, (pk, pv) in zip(rows, pos, prefix):  # each row's prefix, one prefill pass a row
            meta = r.plan([row], a, [0], [a])
            r.write(0, meta, pk, pv)
            r.end()
            row.length = a
        meta = r.plan(rows, L, pos, lens)
        assert isinstance(meta, (PortableQuantStep if route == "portable" else QuantPagedDecode) if in_place
                          else QuantPrefill)
        r.write(0, meta, k, v)
        outs.append(r.attend(0, meta, q, D ** -0.5))
        r.end()
        # the packed pages, and the tails' tokens (a sealed tail's slots are dead; the paths leave them differently)
        bufs.append(store.q[0] + [t[i, :, :(a + n) % P] for t in (store.tk[0], store.tv[0])
                                  for i, (a, n) in enumerate(zip(pos, lens))])
    for x, y in zip(*bufs):
        assert mx.array_equal(x, y).item()
    for b, n in enumerate(lens):
        assert mx.allclose(outs[0][b, :, :n], outs[1][b, :, :n], atol=1e-4).item(), b
