"""The portable route's decode step (what Apple's Metal backend runs): pages read in place against pages gathered.

One decode step of a one-layer model (so one layer's K/V is the whole cache) over B rows of T stored tokens (random
K/V on the cache's pages), through engine.options.route=portable as it is (`in_place`: dense pages by gather_mm,
packed pages by gather_qmm, engine/kv/routes/portable.py) and through the portable route's former decode (`gathered`:
each row's pages copied by the page table into contiguous K/V, then MLX's SDPA, or quantized_matmul on the gathered
packed pages). The two alternate step by step (A, B, A, B, ...) so both see the same machine; per side the median
step ms over --reps steps, and the workspace of one step: MLX's peak memory during it less its active memory before
it, as a share of the KV bytes in use. Also the largest |difference| between the two sides' logits.

    python -m benchmarks engine.portable_decode --kv none,q8,q4 --contexts 256,1024,4096,16384 --batch 8
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import mlx.core as mx

from benchmarks import harness as h
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.kv.routes.base import Geometry
from kvbatch.engine.kv.routes.dense import DenseRoute
from kvbatch.engine.kv.routes.quant import QuantRoute
from kvbatch.engine.kv.store import QuantizedStore
from kvbatch.engine.memory import kv_layout
from kvbatch.engine.mlx_lm_bridge import forward_last, prepare_model
from kvbatch.engine.models.load import load_model

SMOKE = ["--kv", "none,q8", "--contexts", "128", "--batch", "2", "--reps", "2"]
OPTIONS = EngineOptions(route="portable")


def add_args(ap) -> None:
    ap.add_argument("--kv", default="none,q8,q4", help="KV modes")
    ap.add_argument("--contexts", default="256,1024,4096,16384", help="stored tokens per row")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10, help="timed steps per side")


def _cache(m, mode: str, T: int, B: int, P: int) -> tuple[PagedKVCache, list[CacheRow]]:
    """A portable cache of B rows holding T - 1 tokens (random K/V), ready for the step that stores token T."""
    _, _, spec = m
    lay = kv_layout(spec, mode, P, 64)
    cache = PagedKVCache(lay, 1, mx.float32, B, False, spec.num_heads, OPTIONS)
    rows = [CacheRow(f"r{i}") for i in range(B)]
    for r in rows:
        cache.admit(r)
        cache.reserve(r, T, 1 << 45)
        r.length = T - 1
    st, shape = cache.store, (cache.capacity_pages * P, spec.num_kv_heads, spec.head_dim)
    if isinstance(st, QuantizedStore):
        st.store_pages(0, mx.arange(shape[0], dtype=mx.int32), mx.random.normal(shape), mx.random.normal(shape))
        st.tk[0], st.tv[0] = mx.random.normal(st.tk[0].shape), mx.random.normal(st.tv[0].shape)
    else:
        st.k[0], st.v[0] = mx.random.normal(st.k[0].shape), mx.random.normal(st.v[0].shape)
    mx.eval(st.all_arrays())
    return cache, rows


def _gathered(cache: PagedKVCache):
    """The portable route's decode before it read pages in place, on the same store."""
    st, lay = cache.store, cache.layout
    geom = Geometry(lay.page_size, lay.num_kv_heads, lay.head_dim, cache.attention.geom.query_heads)
    if isinstance(st, QuantizedStore):
        return QuantRoute(st, geom, [None], in_place=False)
    return DenseRoute(st, geom, False, cpu=False, in_place=False)


def _step(model, cache: PagedKVCache, rows: list[CacheRow], route) -> tuple[mx.array, float, int]:
    """One decode step through `route` (logits, seconds, workspace bytes); the rows stay at their length."""
    cache.attention = route
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    cache.begin(rows, 1)
    out = forward_last(model, mx.array([[5]] * len(rows)), cache.views)
    mx.eval(out, cache.store.all_arrays())
    dt = time.perf_counter() - t0
    cache.end()
    for r in rows:
        r.length -= 1
    return out, dt, mx.get_peak_memory() - before


def run(a) -> dict:
    base = "tiny" if a.smoke else "tiny-4m"  # its geometry with one layer
    cfg = replace(h.model_config(base), name=f"{base}-1layer", num_layers=1, context_length=1 << 17)
    m = load_model(cfg)
    model, _, spec = m
    prepare_model(model, OPTIONS)
    out = []
    for mode in a.kv.split(","):
        for T in map(int, a.contexts.split(",")):
            cache, rows = _cache(m, mode, T, a.batch, a.page_size)
            sides = {"in_place": cache.attention, "gathered": _gathered(cache)}
            times: dict = {k: [] for k in sides}
            work: dict = {k: [] for k in sides}
            logits = {}
            for k, route in sides.items():  # warm-up: one-time allocations
                logits[k] = _step(model, cache, rows, route)[0]
            mx.clear_cache()
            for _ in range(a.reps):
                for k, route in sides.items():
                    _, dt, ws = _step(model, cache, rows, route)
                    times[k].append(dt)
                    work[k].append(ws)
            kv = cache.pool.in_use * cache.layout.page_bytes
            row = {"kv": mode, "context": T, "batch": a.batch, "kv_bytes": kv,
                   "max_abs_diff": float(mx.abs(logits["in_place"] - logits["gathered"]).max())}
            for k in sides:
                row[k] = {"step_ms": statistics.median(times[k]) * 1e3,
                          "workspace_share": statistics.median(work[k]) / kv}
            row["speedup"] = row["gathered"]["step_ms"] / row["in_place"]["step_ms"]
            print(row, flush=True)
            out.append(row)
            del cache, rows
            mx.clear_cache()
    return {"model": spec.name, "page_size": a.page_size, "rows": out}
