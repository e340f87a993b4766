"""CPU decode attention read from the pages in place (`paged_grouped_decode`) against the
gathered path (`_grouped_decode` on K/V copied out by the page table)."""
from __future__ import annotations

import engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from engine.attention import _grouped_decode, paged_grouped_decode


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
