"""MLX CUDA: a few-token pass (a speculative verification window, a short prompt tail) attends
through paged_window_attention (engine.options.multi_query): it stores the same K/V as the prefill
path and each real query's output matches the prefill path's (gathered pages, composed matmuls) within
bf16 rounding, and has the bits decode gives that query at its own length, on the tensor cores and
without (engine.options.cuda.tensor_cores: speculation keeps decode's tokens); rows at different
positions, one crossing into a new page, one with a single token beside rows of five, one long enough
to split. The plan's counts are checked
on any backend; the kernel runs on MLX CUDA only (the speculative tests run it there end to end)."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.config import CudaLaunch
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.routes.base import Geometry
from kvbatch.engine.kv.routes.cuda import CudaDenseRoute, CudaMulti
from kvbatch.engine.kv.routes.cuda_kernels import paged_decode_attention
from kvbatch.engine.kv.routes.dense import DenseStep
from kvbatch.engine.kv.store import DenseStore
from tests.conftest import ON_CUDA


def _rows(pos: list[int], n_pages: list[int]) -> list[CacheRow]:
    first, rows = 1, []
    for i, n in enumerate(n_pages):  # pages not in order, none shared
        rows.append(CacheRow(f"r{i}", pages=list(range(first + n - 1, first - 1, -1)), length=pos[i]))
        first += n
    return rows


def test_window_plan_counts_each_rows_keys():
    """Row b's queries see pos[b] + j + 1 keys (firsts = pos), padding positions all its pos + lens keys."""
    pos, lens, P = [5, 37], [3, 1], 16
    store = DenseStore(1, 2, 64, P, mx.float32)
    store.grow(6)
    route = CudaDenseRoute(store, Geometry(P, 2, 64, 8), False, CudaLaunch(), False, 8)
    meta = route.plan(_rows(pos, [1, 3]), 3, pos, lens)
    assert isinstance(meta, CudaMulti)
    assert meta.firsts.tolist() == [5, 37] and meta.lengths.tolist() == [8, 38]
    assert meta.step.table.shape[0] == 2  # one table row a row, not one a position


@pytest.mark.skipif(not ON_CUDA, reason="the fused kernels run on MLX CUDA only")
@pytest.mark.parametrize("page", [16, 64])
def test_multi_query_pass_matches_prefill_path(page):
    Hkv, Hq, D, L = 2, 8, 64, 5
    pos, lens = [5, 60, 130, 2000], [5, 3, 1, 5]
    n_pages = [-(-(a + n) // page) for a, n in zip(pos, lens)]
    outs, stores = [], []
    # the window on the tensor cores, through the decode kernel once a position, the prefill path
    for multi, launch in ((8, CudaLaunch()), (8, CudaLaunch(tensor_cores=False)), (1, CudaLaunch())):
        mx.random.seed(3)
        store = DenseStore(1, Hkv, D, page, mx.bfloat16)
        store.grow(sum(n_pages) + 2)
        store.k[0] = mx.random.normal(store.k[0].shape).astype(mx.bfloat16)
        store.v[0] = mx.random.normal(store.v[0].shape).astype(mx.bfloat16)
        rows = _rows(pos, n_pages)
        route = CudaDenseRoute(store, Geometry(page, Hkv, D, Hq), False, launch, False, multi)
        meta = route.plan(rows, L, pos, lens)
        assert isinstance(meta, CudaMulti if multi > 1 else DenseStep)
        q = mx.random.normal((len(pos), Hq, L, D)).astype(mx.bfloat16)
        k = mx.random.normal((len(pos), Hkv, L, D)).astype(mx.bfloat16)
        v = mx.random.normal((len(pos), Hkv, L, D)).astype(mx.bfloat16)
        route.write(0, meta, k, v)
        out = route.attend(0, meta, q, D ** -0.5)
        if multi > 1:  # decode under the same settings, one launch a position at its own key count: the same bits
            table = meta.step.table
            for j in range(L):
                n = mx.array([a + min(j + 1, m) for a, m in zip(pos, lens)], dtype=mx.int32)
                one = paged_decode_attention(q[:, :, j:j + 1], store.k[0], store.v[0], table, n, D ** -0.5, launch)
                want = [b for b, m in enumerate(lens) if j < m]
                a, r = out[want, :, j], one[want, :, 0]
                assert mx.array_equal(a, r).item(), (launch, j, mx.abs(a.astype(mx.float32) - r).max().item())
        route.end()
        mx.eval(out, store.k[0], store.v[0])
        outs.append(out)
        stores.append((store.k[0], store.v[0]))
    for o, st in zip(outs[1:], stores[1:]):
        assert mx.array_equal(stores[0][0], st[0]).item() and mx.array_equal(stores[0][1], st[1]).item()
        for b, n in enumerate(lens):
            a, r = outs[0][b, :, :n].astype(mx.float32), o[b, :, :n].astype(mx.float32)
            assert mx.allclose(a, r, atol=2e-2, rtol=2e-2).item(), (b, mx.abs(a - r).max().item())
