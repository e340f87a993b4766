"""Fused paged decode attention for MLX's CUDA backend (mx.fast.cuda_kernel).

The portable route gathers every row's pages into a contiguous (B, kv_heads, T,
head_dim) copy each step and then runs SDPA: the KV bytes cross memory three
times. This kernel reads each row's pages in place through its page table, once:
one thread block per (row, KV head), one warp per token at a time, the KV head's
query group (GQA) handled together so each K/V element is loaded once; online
softmax, all in float32. Decode only (one query per row); prefill keeps the
portable route. Tested against the portable path by benchmarks/backend_check.py
on the GPU.
"""
from __future__ import annotations

import mlx.core as mx

WARPS = 8

_SOURCE = r"""
    constexpr int E = D / 32;
    const int bh = blockIdx.x;
    const int b = bh / HKV, hk = bh % HKV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int len = lengths[b];
    const int maxp = meta[0];
    const float sc = scale[0];
    float qr[REP][E];
    float m[REP], l[REP], acc[REP][E];
    for (int r = 0; r < REP; ++r) {
        for (int e = 0; e < E; ++e) {
            qr[r][e] = static_cast<float>(q[((size_t)(b * HKV + hk) * REP + r) * D + lane * E + e]) * sc;
            acc[r][e] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    for (int t = warp; t < len; t += NW) {
        const int page = table[(size_t)b * maxp + t / P];
        const size_t base = (((size_t)page * HKV + hk) * P + (t % P)) * D + lane * E;
        float kv[E], vv[E];
        for (int e = 0; e < E; ++e) {
            kv[e] = static_cast<float>(k[base + e]);
            vv[e] = static_cast<float>(v[base + e]);
        }
        for (int r = 0; r < REP; ++r) {
            float s = 0.f;
            for (int e = 0; e < E; ++e) s += qr[r][e] * kv[e];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            const float mn = fmaxf(m[r], s);
            const float corr = __expf(m[r] - mn);
            const float p = __expf(s - mn);
            l[r] = l[r] * corr + p;
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * corr + p * vv[e];
            m[r] = mn;
        }
    }
    __shared__ float sm[NW][REP];
    __shared__ float sl[NW][REP];
    __shared__ float sacc[NW][REP][D];
    for (int r = 0; r < REP; ++r) {
        if (lane == 0) { sm[warp][r] = m[r]; sl[warp][r] = l[r]; }
        for (int e = 0; e < E; ++e) sacc[warp][r][lane * E + e] = acc[r][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        float M = -INFINITY;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][r]);
        float L = 0.f, A = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float c = (sm[w][r] == -INFINITY) ? 0.f : __expf(sm[w][r] - M);
            L += sl[w][r] * c;
            A += sacc[w][r][d] * c;
        }
        out[((size_t)(b * HKV + hk) * REP + r) * D + d] = static_cast<T>(A / L);
    }
"""

_kernel = None


def usable(layout, store, query_heads: int) -> bool:
    """On MLX CUDA, for head-major dense pages whose shapes the kernel handles.
    KVBATCH_FUSED_ATTENTION=0 turns it off (the portable route then runs)."""
    import os

    if os.environ.get("KVBATCH_FUSED_ATTENTION", "1") == "0":
        return False
    if not (mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel")):
        return False
    if getattr(store, "k", None) is None or store.k[0].ndim != 4 or layout.head_dim % 32:
        return False
    rep = max(query_heads // layout.num_kv_heads, 1)
    return WARPS * rep * (layout.head_dim + 2) * 4 <= 44 * 1024  # static shared memory


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array,
                           lengths: mx.array, scale: float) -> mx.array:
    """q (B, Hq, 1, D); pools (pages, Hkv, P, D); table (B, maxp) int32; lengths (B,) int32
    (keys stored, the new token included) -> (B, Hq, 1, D)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="kvbatch_paged_decode",
            input_names=["q", "k", "v", "table", "lengths", "meta", "scale"],
            output_names=["out"],
            source=_SOURCE,
        )
    B, Hq, _, D = q.shape
    _, Hkv, P, _ = k_pool.shape
    rep = Hq // Hkv
    meta = mx.array([table.shape[1]], dtype=mx.int32)
    (out,) = _kernel(
        inputs=[q.reshape(B, Hq, D), k_pool, v_pool, table.astype(mx.int32), lengths.astype(mx.int32), meta,
                mx.array([scale], dtype=mx.float32)],
        template=[("T", q.dtype), ("D", D), ("P", P), ("REP", rep), ("HKV", Hkv), ("NW", WARPS)],
        grid=(B * Hkv * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, Hq, D)],
        output_dtypes=[q.dtype],
    )
    return out.reshape(B, Hq, 1, D)
