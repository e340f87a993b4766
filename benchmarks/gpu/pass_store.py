"""What storing a multi-token pass's K/V costs while a decode step is in flight (MLX CUDA): MLX's scatter
(`engine.options.cuda.kernel_stores=false`) against the in-place store kernel (cuda_kernels.store_pass_tokens).

A prefill chunk or a verification window writes its K/V into every layer's pools while the lookahead's decode
step still reads them. MLX's scatter writes into its input's memory only when nothing else holds the array,
so with a step in flight it copies the layer's pool first. Here each of --layers layers has its own K and V
pools of --pool-mib MiB; a "step in flight" (one read of every pool, evaluated asynchronously) is dispatched,
then one pass stores --tokens tokens into every layer and reads them back through the pass's table. Reported
per side: the median pass time over --iters passes (the in-flight step's time included: the pass queues
behind it) and the peak memory over the pools during the pass (a copy shows as one more pool).

    python -m benchmarks gpu.pass_store --pool-mib 512 --layers 30 --tokens 8192
"""
from __future__ import annotations

import statistics
import time

import mlx.core as mx

from kvbatch.engine.kv.routes.cuda_kernels import store_pass_tokens
from kvbatch.engine.kv.store import head_rows_array, scatter_rows

NEEDS = "cuda"
SMOKE = ["--pool-mib", "16", "--layers", "2", "--tokens", "64", "--iters", "2"]


def add_args(ap) -> None:
    ap.add_argument("--pool-mib", type=int, default=512, help="MiB of each K and each V pool of a layer")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens the pass stores in every layer")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)


def _pass(pools: list, rows: mx.array, k: mx.array, v: mx.array, table: mx.array, kernel: bool) -> list:
    """One pass: every layer stores the tokens, then reads a page back through the table its store gave."""
    outs = []
    for i, (kp, vp) in enumerate(pools):
        if kernel:
            t = store_pass_tokens(kp, vp, rows, k, v, table)
        else:
            kp, vp = scatter_rows(kp, rows, k), scatter_rows(vp, rows, v)
            pools[i] = (kp, vp)
            t = table
        outs.append(kp[t[0, 0]].sum() + vp[t[0, 0]].sum())
    return outs


def run(a) -> dict:
    H, D, P = a.kv_heads, a.head_dim, a.page
    pages = (a.pool_mib << 20) // (H * P * D * 2)
    pools = [(mx.zeros((pages, H, P, D), dtype=mx.bfloat16), mx.zeros((pages, H, P, D), dtype=mx.bfloat16))
             for _ in range(a.layers)]
    mx.eval(pools)
    n_pages = -(-a.tokens // P)
    first = pages - n_pages  # the pass's pages: the pools' last ones
    slots = [(first + t // P) * P + t % P for t in range(a.tokens)]
    rows = mx.array(head_rows_array(slots, P, H))
    k = mx.random.normal((a.tokens, H, D)).astype(mx.bfloat16)
    v = mx.random.normal((a.tokens, H, D)).astype(mx.bfloat16)
    table = mx.arange(first, pages, dtype=mx.int32)[None]
    pool_bytes = 2 * a.layers * pages * H * P * D * 2
    result: dict = {"pool_mib": a.pool_mib, "layers": a.layers, "tokens": a.tokens, "pools_gib": pool_bytes / 2**30}
    for side in ("scatter", "kernel", "scatter", "kernel"):  # alternating; the last of each kept with the first
        kernel = side == "kernel"
        times, peaks = [], []
        for _ in range(a.iters):
            mx.synchronize()
            inflight = [kp[: pages // 2].sum() + vp[: pages // 2].sum() for kp, vp in pools]  # the step in flight
            mx.async_eval(inflight)
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            t0 = time.perf_counter()
            mx.eval(_pass(pools, rows, k, v, table, kernel))
            mx.synchronize()
            times.append(time.perf_counter() - t0)
            peaks.append(mx.get_peak_memory() - before)
            del inflight
        got = result.setdefault(side, {"pass_ms": [], "peak_over_pools_mib": []})
        got["pass_ms"].append(round(statistics.median(times) * 1e3, 3))
        got["peak_over_pools_mib"].append(round(max(peaks) / 2**20, 1))
    kp, _ = pools[0]
    stored = kp.reshape(-1, D)[rows].reshape(a.tokens, H, D)
    result["stored_bits_equal"] = bool(mx.array_equal(stored, k).item())
    return result
