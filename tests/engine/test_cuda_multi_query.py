"""MLX CUDA: a few-token pass (a speculative verification window, a short prompt tail) attends
through the fused decode kernel, one query per (row, position) (engine.options.multi_query):
it stores the same K/V as the prefill path and each real query's output matches the prefill
path's (gathered pages, composed matmuls) within bf16 rounding; rows at different positions, one
crossing into a new page, one with a single token beside rows of five. Skipped off CUDA (the CPU
and portable routes never take this path; the speculative tests run it on CUDA end to end)."""
from __future__ import annotations

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from kvbatch.engine.config import CudaLaunch
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.routes.base import Geometry
from kvbatch.engine.kv.routes.cuda import CudaDenseRoute, CudaMulti, multi_lengths
from kvbatch.engine.kv.routes.dense import DenseStep
from kvbatch.engine.kv.store import DenseStore
from tests.conftest import ON_CUDA


def test_multi_lengths_mark_each_querys_keys():
    """Query j of a row at pos sees pos + j + 1 keys; padding positions see the row's real keys."""
    assert multi_lengths([5, 37], [3, 1], 3) == [6, 7, 8, 38, 38, 38]


@pytest.mark.skipif(not ON_CUDA, reason="the fused kernels run on MLX CUDA only")
@pytest.mark.parametrize("page", [16, 64])
def test_multi_query_pass_matches_prefill_path(page):
    Hkv, Hq, D, L = 2, 8, 64, 5
    pos, lens = [5, 60, 130, 2000], [5, 3, 1, 5]
    n_pages = [-(-(a + n) // page) for a, n in zip(pos, lens)]
    outs, stores = [], []
    for multi in (8, 1):
        mx.random.seed(3)
        store = DenseStore(1, Hkv, D, page, mx.bfloat16)
        store.grow(sum(n_pages) + 2)
        store.k[0] = mx.random.normal(store.k[0].shape).astype(mx.bfloat16)
        store.v[0] = mx.random.normal(store.v[0].shape).astype(mx.bfloat16)
        first, rows = 1, []
        for i, n in enumerate(n_pages):  # pages not in order, none shared
            rows.append(CacheRow(f"r{i}", pages=list(range(first + n - 1, first - 1, -1)), length=pos[i]))
            first += n
        route = CudaDenseRoute(store, Geometry(page, Hkv, D, Hq), False, CudaLaunch(), False, multi)
        meta = route.plan(rows, L, pos, 0, lens)
        assert isinstance(meta, CudaMulti if multi > 1 else DenseStep)
        q = mx.random.normal((len(pos), Hq, L, D)).astype(mx.bfloat16)
        k = mx.random.normal((len(pos), Hkv, L, D)).astype(mx.bfloat16)
        v = mx.random.normal((len(pos), Hkv, L, D)).astype(mx.bfloat16)
        route.write(0, meta, k, v)
        out = route.attend(0, meta, q, D ** -0.5)
        route.end()
        mx.eval(out, store.k[0], store.v[0])
        outs.append(out)
        stores.append((store.k[0], store.v[0]))
    assert mx.array_equal(stores[0][0], stores[1][0]).item() and mx.array_equal(stores[0][1], stores[1][1]).item()
    for b, n in enumerate(lens):
        a, r = outs[0][b, :, :n].astype(mx.float32), outs[1][b, :, :n].astype(mx.float32)
        assert mx.allclose(a, r, atol=2e-2, rtol=2e-2).item(), (b, mx.abs(a - r).max().item())
