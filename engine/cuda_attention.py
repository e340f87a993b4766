"""Fused paged decode attention for MLX's CUDA backend (mx.fast.cuda_kernel).

The portable route gathers every row's pages into a contiguous copy each step and
then runs SDPA (dense) or quantized matmuls (q8/q4): the KV bytes cross memory
several times. These kernels read each row's pages in place through its page
table, once. A KV head's query group (GQA) is handled together so each K/V element
is loaded once; 8 head elements per lane (one 16-byte load for bf16, 8 or 4 bytes
of packed q8/q4), D/8 lanes per token, several tokens per warp; online softmax in
float32. Quantized pages are dequantized in registers (affine: w * scale + bias);
the row's dense tail page is read from the tail buffer. In decode the kernel also stores the
step's new K/V (`new_kv`; kv_cache.PagedKVCache.kernel_writes): two scatters and their copies
per layer fewer for the host to launch.

Split-K (flash-decoding): a row longer than SPLIT_MIN tokens is split over several
blocks by token ranges of CHUNK tokens; each writes its partial (max, sum,
unnormalised output) and a second kernel merges the row's partials in order. The
ranges depend on the row's own length only, never on its batch mates (the longest
row, the batch size): a row's output is the same bits whichever rows share its
batch. (An unsplit row gives the same bits through either kernel: its one partial
is merged with weight exactly 1.) Decode only (one query per row); prefill keeps
the portable route. Tested against a float64 reference by benchmarks/backend_check.py.
"""
from __future__ import annotations

import os

import mlx.core as mx

NE = 8  # head elements per lane
UNROLL = int(os.environ.get("KVBATCH_CUDA_UNROLL", "2"))  # tokens per lane per loop step
# Tokens per split: a row of more than SPLIT_MIN tokens runs ceil(its length / CHUNK) splits.
# Shorter rows are not split: a block over at most SPLIT_MIN tokens is short anyway, and the
# split path adds a kernel launch and partial buffers per layer, which at small batches (where
# a decode step is bound by the host's launches) is pure cost. A choice, not a measured optimum
# (RESULTS.md, issue 9).
# KVBATCH_CUDA_CHUNK=N overrides both (splits of N tokens from N tokens on; 0 = never split).
CHUNK = 256
SPLIT_MIN = 1024

_HEAD = r"""
    constexpr int TPW = 32 / LPT;
    const int maxp = meta[0], ns = meta[1];
    const int bh = blockIdx.x / ns, sp = blockIdx.x % ns;
    const int b = bh / HKV, hk = bh % HKV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int sub = lane / LPT, li = lane % LPT;
    const bool on = li * NE < D;
    {lens}
    const int chunk = len > meta[3] ? meta[2] : len;  // this row's own ranges (unsplit if short)
    const int t0 = sp * chunk, t1 = min(len, t0 + chunk);
    if (sp > 0 && t0 >= len) return;  // past this row's own splits (the whole block: no sync below)
    const float sc = scale[0];
    float qr[REP][NE], m[REP], l[REP], acc[REP][NE];
    for (int r = 0; r < REP; ++r) {{
        for (int e = 0; e < NE; ++e) {{
            qr[r][e] = on ? static_cast<float>(q[((size_t)bh * REP + r) * D + li * NE + e]) * sc : 0.f;
            acc[r][e] = 0.f;
        }}
        m[r] = -INFINITY;
        l[r] = 0.f;
    }}
    struct alignas(16) V8 {{ S x[NE]; }};
"""

# One pass over tokens [ta, tz): `load` fills kf[u][e], vf[u][e] for token t (lane li's elements).
_LOOP = r"""
    {{
        const int ta = {start}, tz = {stop};
        for (int tb = ta + warp * TPW * U; tb < tz; tb += NW * TPW * U) {{
            float kf[U][NE], vf[U][NE];
            bool valid[U];
            for (int u = 0; u < U; ++u) {{
                const int t = tb + u * TPW + sub;
                valid[u] = t < tz;
                if (valid[u] && on) {{
                    {load}
                }} else {{
                    for (int e = 0; e < NE; ++e) {{ kf[u][e] = 0.f; vf[u][e] = 0.f; }}
                }}
            }}
            for (int r = 0; r < REP; ++r) {{
                float s[U];
                float mn = m[r];
                bool any = false;
                for (int u = 0; u < U; ++u) {{
                    float x = 0.f;
                    for (int e = 0; e < NE; ++e) x += qr[r][e] * kf[u][e];
                    for (int o = LPT / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
                    s[u] = x;
                    if (valid[u]) {{ mn = fmaxf(mn, x); any = true; }}
                }}
                if (!any) continue;
                if (mn > m[r]) {{  // rescale only when the running max moves (rarely, once warm)
                    const float corr = __expf(m[r] - mn);
                    l[r] *= corr;
                    for (int e = 0; e < NE; ++e) acc[r][e] *= corr;
                    m[r] = mn;
                }}
                for (int u = 0; u < U; ++u) {{
                    if (!valid[u]) continue;
                    const float p = __expf(s[u] - m[r]);  // NaN scores stay NaN (fmaxf skips them)
                    l[r] += p;
                    for (int e = 0; e < NE; ++e) acc[r][e] += p * vf[u][e];
                }}
            }}
        }}
    }}
"""

_DENSE_LOAD = r"""
                    const int page = table[(size_t)b * maxp + t / P];
                    const size_t base = (((size_t)page * HKV + hk) * P + (t % P)) * D + li * NE;
                    const V8 kk = *reinterpret_cast<const V8*>(k + base);
                    const V8 vv = *reinterpret_cast<const V8*>(v + base);
                    for (int e = 0; e < NE; ++e) {
                        kf[u][e] = static_cast<float>(kk.x[e]);
                        vf[u][e] = static_cast<float>(vv.x[e]);
                    }
"""

_TAIL_LOAD = r"""
                    const size_t base = (((size_t)tails[b] * HKV + hk) * P + (t - n_main)) * D + li * NE;
                    const V8 kk = *reinterpret_cast<const V8*>(tk + base);
                    const V8 vv = *reinterpret_cast<const V8*>(tv + base);
                    for (int e = 0; e < NE; ++e) {
                        kf[u][e] = static_cast<float>(kk.x[e]);
                        vf[u][e] = static_cast<float>(vv.x[e]);
                    }
"""

_QUANT_LOAD = r"""
                    constexpr int WPL = NE * BITS / 32, W = D * BITS / 32, G = D / GS;
                    struct alignas(4 * WPL) QW { uint32_t x[WPL]; };
                    const int page = table[(size_t)b * maxp + t / P];
                    const size_t slot = ((size_t)page * HKV + hk) * P + (t % P);
                    const size_t wo = slot * W + li * WPL, go = slot * G + (li * NE) / GS;
                    const QW kq = *reinterpret_cast<const QW*>(kw + wo);
                    const QW vq = *reinterpret_cast<const QW*>(vw + wo);
                    const float ks_ = static_cast<float>(ks[go]), kb_ = static_cast<float>(kb[go]);
                    const float vs_ = static_cast<float>(vs[go]), vb_ = static_cast<float>(vb[go]);
                    for (int e = 0; e < NE; ++e) {  // code -> float as 2^23 + code, minus 2^23 (no I2F)
                        const uint32_t a = kq.x[(e * BITS) / 32], c = vq.x[(e * BITS) / 32];
                        const uint32_t ka = BITS == 8 ? __byte_perm(a, 0x4B000000u, (e % 4) | 0x7440)
                                                      : ((a >> ((e * BITS) % 32)) & 0xFu) | 0x4B000000u;
                        const uint32_t va = BITS == 8 ? __byte_perm(c, 0x4B000000u, (e % 4) | 0x7440)
                                                      : ((c >> ((e * BITS) % 32)) & 0xFu) | 0x4B000000u;
                        kf[u][e] = ks_ * (__uint_as_float(ka) - 8388608.f) + kb_;
                        vf[u][e] = vs_ * (__uint_as_float(va) - 8388608.f) + vb_;
                    }
"""

# The step's new token (t == len - 1), when the kernel also stores it (`new_kv`): the block
# whose token range holds it writes it from the projections (kn/vn, (B, HKV, D)) into its page
# slot (dense) or tail slot (q8/q4) before its loop, for later steps; every read of that token in
# this launch takes it from kn/vn (the same bits), so no thread waits for the store, and the
# loop's loads are not ordered behind a store that may alias them. No other block of this launch
# touches that slot. MLX custom kernels have no in-place outputs, so the store goes through the
# input pointer: the pages are written in place, as MLX's own donated scatter would write them.
_NEW_KV = r"""
    if (threadIdx.x < LPT && on && t0 <= len - 1 && len - 1 < t1) {{  // warp 0, first token group
        const int tn = len - 1;
        const size_t nb = ((size_t)b * HKV + hk) * D + li * NE, base = {base};
        *reinterpret_cast<V8*>(const_cast<S*>({k}) + base) = *reinterpret_cast<const V8*>(kn + nb);
        *reinterpret_cast<V8*>(const_cast<S*>({v}) + base) = *reinterpret_cast<const V8*>(vn + nb);
    }}
"""
_NEW_SEL = "(t == len - 1 ? {n} + ((size_t)b * HKV + hk) * D + li * NE : {p} + base)"

# Merge the warp's token sub-groups (shuffles), then the block's warps (shared memory).
_MERGE = r"""
    for (int o = LPT; o < 32; o <<= 1) {
        for (int r = 0; r < REP; ++r) {
            const float mo = __shfl_xor_sync(0xffffffff, m[r], o);
            const float lo = __shfl_xor_sync(0xffffffff, l[r], o);
            const float M = fmaxf(m[r], mo);
            const float c1 = (m[r] == -INFINITY) ? 0.f : __expf(m[r] - M);
            const float c2 = (mo == -INFINITY) ? 0.f : __expf(mo - M);
            l[r] = l[r] * c1 + lo * c2;
            for (int e = 0; e < NE; ++e) {
                const float ao = __shfl_xor_sync(0xffffffff, acc[r][e], o);
                acc[r][e] = acc[r][e] * c1 + ao * c2;
            }
            m[r] = M;
        }
    }
    __shared__ float sm[NW][REP];
    __shared__ float sl[NW][REP];
    __shared__ float sacc[NW][REP][D];
    if (sub == 0) {
        for (int r = 0; r < REP; ++r) {
            if (li == 0) { sm[warp][r] = m[r]; sl[warp][r] = l[r]; }
            if (on) for (int e = 0; e < NE; ++e) sacc[warp][r][li * NE + e] = acc[r][e];
        }
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
"""

_WRITE_OUT = r"""
        out[((size_t)bh * REP + r) * D + d] = static_cast<T>(A / L);
    }
"""

_WRITE_PART = r"""
        const size_t pr = ((size_t)bh * ns + sp) * REP + r;
        if (d == 0) { pm[pr] = M; pl[pr] = L; }
        pacc[pr * D + d] = A;
    }
"""

_REDUCE = r"""
    const int ns = meta[1];
    const int bh = blockIdx.x, b = bh / HKV;
    const int len = QL ? lens[2 * b] + lens[2 * b + 1] : lens[b];
    const int nr = len > meta[3] ? min(ns, (len + meta[2] - 1) / meta[2]) : 1;  // this row's own splits
    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        float M = -INFINITY;
        for (int s = 0; s < nr; ++s) M = fmaxf(M, pm[((size_t)bh * ns + s) * REP + r]);
        float L = 0.f, A = 0.f;
        for (int s = 0; s < nr; ++s) {
            const size_t pr = ((size_t)bh * ns + s) * REP + r;
            // weight exactly 1 for the split that holds the max: one split = the unsplit kernel's bits
            const float c = (pm[pr] == M) ? 1.f : (pm[pr] == -INFINITY) ? 0.f : __expf(pm[pr] - M);
            L += pl[pr] * c;
            A += pacc[pr * D + d] * c;
        }
        out[((size_t)bh * REP + r) * D + d] = static_cast<T>(A / L);
    }
"""

_DENSE_INPUTS = ["q", "k", "v", "table", "lengths", "meta", "scale"]
_QUANT_INPUTS = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "tails", "table", "lens", "meta", "scale"]


def kernel_source(quantized: bool, split: bool, new_kv: bool = False) -> str:
    """The kernel body (also compiled by benchmarks/backend_check.py's nvcc check). new_kv: the
    kernel also stores the step's token (inputs kn, vn) into its dense page / tail page."""
    k, v = ("tk", "tv") if quantized else ("k", "v")
    load = _TAIL_LOAD if quantized else _DENSE_LOAD
    store = ""
    if new_kv:
        base = ("(((size_t)tails[b] * HKV + hk) * P + (tn - n_main)) * D + li * NE" if quantized else
                "(((size_t)table[(size_t)b * maxp + tn / P] * HKV + hk) * P + (tn % P)) * D + li * NE")
        store = _NEW_KV.format(k=k, v=v, base=base)
        load = (load.replace(f"({k} + base)", _NEW_SEL.format(n="kn", p=k))
                .replace(f"({v} + base)", _NEW_SEL.format(n="vn", p=v)))
    if quantized:
        head = _HEAD.format(lens="const int n_main = lens[2 * b], len = n_main + lens[2 * b + 1];")
        body = (_LOOP.format(start="t0", stop="min(t1, n_main)", load=_QUANT_LOAD)
                + _LOOP.format(start="max(t0, n_main)", stop="t1", load=load))
    else:
        head = _HEAD.format(lens="const int len = lengths[b];")
        body = _LOOP.format(start="t0", stop="t1", load=load)
    return head + store + body + _MERGE + (_WRITE_PART if split else _WRITE_OUT)


_kernels: dict = {}


def _kernel(kind: str, split: bool, new_kv: bool = False):
    key = (kind, split, new_kv)
    if key not in _kernels:
        if kind == "reduce":
            _kernels[key] = mx.fast.cuda_kernel(name="kvbatch_paged_reduce2",
                                                input_names=["pm", "pl", "pacc", "meta", "lens"],
                                                output_names=["out"], source=_REDUCE)
        else:
            q = kind == "quant"
            _kernels[key] = mx.fast.cuda_kernel(
                name=f"kvbatch_paged_decode2_{kind}{'_split' if split else ''}{'_store' if new_kv else ''}",
                input_names=(_QUANT_INPUTS if q else _DENSE_INPUTS) + (["kn", "vn"] if new_kv else []),
                output_names=["pm", "pl", "pacc"] if split else ["out"],
                source=kernel_source(q, split, new_kv))
    return _kernels[key]


def _lanes(head_dim: int) -> int:
    lpt = 1
    while lpt * NE < head_dim:
        lpt *= 2
    return lpt


def warps_for(head_dim: int, rep: int) -> int:
    """Warps per block whose merge buffers fit in static shared memory (0: none do)."""
    for nw in (8, 4):
        if nw * rep * (head_dim + 2) * 4 <= 44 * 1024:
            return nw
    return 0


def supports(head_dim: int, rep: int, bits: int | None = None, group_size: int | None = None) -> bool:
    """Whether the kernels handle this geometry (and quantization)."""
    if head_dim % NE or head_dim > 32 * NE or warps_for(head_dim, rep) == 0:
        return False
    return not bits or (bits in (4, 8) and group_size is not None and group_size % NE == 0
                        and head_dim % group_size == 0)


def available() -> bool:
    """MLX CUDA with custom kernels, unless KVBATCH_FUSED_ATTENTION=0 (the portable route then runs)."""
    if os.environ.get("KVBATCH_FUSED_ATTENTION", "1") == "0":
        return False
    return mx.cuda.is_available() and hasattr(mx.fast, "cuda_kernel")


def usable(layout, store, query_heads: int) -> bool:
    """On MLX CUDA, for head-major pages whose shapes the kernels handle."""
    if not available():
        return False
    rep = max(query_heads // layout.num_kv_heads, 1)
    if layout.bits:
        return supports(layout.head_dim, rep, layout.bits, layout.group_size)
    return getattr(store, "k", None) is not None and store.k[0].ndim == 4 and supports(layout.head_dim, rep)


def kernel_writes() -> bool:
    """Whether decode stores each step's new K/V inside the fused kernel (the token's slot is
    written by the thread that reads it) instead of two scatters per layer before it: fewer
    device ops per layer for the host to launch. KVBATCH_CUDA_KERNEL_WRITE=0 turns it off."""
    return os.environ.get("KVBATCH_CUDA_KERNEL_WRITE", "1") != "0"


def chunk_tokens() -> tuple[int, int]:
    """(tokens per split, longest unsplit row): KVBATCH_CUDA_CHUNK=N gives (N, N) (0: never
    split), else (CHUNK, SPLIT_MIN)."""
    env = os.environ.get("KVBATCH_CUDA_CHUNK", "").strip()
    return (int(env), int(env)) if env else (CHUNK, SPLIT_MIN)


def splits_for(max_tokens: int, chunk: int | None = None) -> tuple[int, int, int]:
    """(splits of the longest row = blocks per (row, KV head), tokens per split, longest
    unsplit row). A row splits only if it is longer than the last, into ceil(its own
    length / chunk) ranges: the split ranges never depend on batch mates."""
    chunk, unsplit = chunk_tokens() if chunk is None else (chunk, chunk)
    if chunk <= 0 or max_tokens <= max(chunk, unsplit):
        return 1, max(max_tokens, 1), 0
    return -(-max_tokens // chunk), chunk, unsplit


_consts: dict = {}


def _const(values: tuple, dtype) -> mx.array:
    """Small per-call constants (meta, scale), made once per value: a decode step has the
    same ones in every layer, and each new mx.array is a host-to-device copy."""
    key = (values, dtype)
    a = _consts.get(key)
    if a is None:
        if len(_consts) > 256:
            _consts.clear()
        a = _consts[key] = mx.array(list(values), dtype=dtype)
    return a


def _launch(kind: str, inputs: list, q: mx.array, store_dtype: mx.Dtype, kv_heads: int, page: int,
            max_tokens: int, maxp: int, scale: float, extra: list, chunk: int | None,
            new_kv: tuple[mx.array, mx.array] | None) -> mx.array:
    B, Hq, _, D = q.shape
    lens = inputs[-1]  # (B,) lengths, or (B, 2) sealed + tail tokens
    rep = Hq // kv_heads
    nw = warps_for(D, rep)
    ns, chunk, unsplit = splits_for(max_tokens, chunk)
    meta = _const((maxp, ns, chunk, unsplit), mx.int32)
    template = [("T", q.dtype), ("S", store_dtype), ("D", D), ("P", page), ("REP", rep), ("HKV", kv_heads),
                ("NW", nw), ("LPT", _lanes(D)), ("NE", NE), ("U", UNROLL)] + extra
    args = [q.reshape(B, Hq, D)] + inputs + [meta, _const((float(scale),), mx.float32)]
    if new_kv is not None:
        args += [a.reshape(B, kv_heads, D).astype(store_dtype) for a in new_kv]
    grid, block = (B * kv_heads * ns * 32 * nw, 1, 1), (32 * nw, 1, 1)
    if ns == 1:
        (out,) = _kernel(kind, False, new_kv is not None)(inputs=args, template=template, grid=grid, threadgroup=block,
                                      output_shapes=[(B, Hq, D)], output_dtypes=[q.dtype])
    else:
        n = B * kv_heads * ns * rep
        pm, pl, pacc = _kernel(kind, True, new_kv is not None)(inputs=args, template=template, grid=grid, threadgroup=block,
                                           output_shapes=[(n,), (n,), (n * D,)],
                                           output_dtypes=[mx.float32] * 3)
        (out,) = _kernel("reduce", False)(inputs=[pm, pl, pacc, meta, lens],
                                          template=[("T", q.dtype), ("D", D), ("REP", rep), ("HKV", kv_heads),
                                                    ("QL", int(kind == "quant"))],
                                          grid=(B * kv_heads * 128, 1, 1), threadgroup=(128, 1, 1),
                                          output_shapes=[(B, Hq, D)], output_dtypes=[q.dtype])
    return out.reshape(B, Hq, 1, D)


def paged_decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, table: mx.array,
                           lengths: mx.array, scale: float, chunk: int | None = None,
                           new_kv: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """q (B, Hq, 1, D); pools (pages, Hkv, P, D); table (B, maxp) int32; lengths (B,) int32
    (keys stored, the new token included) -> (B, Hq, 1, D). chunk: tokens per split (None:
    chunk_tokens(); 0: no split). new_kv: this step's (keys, values), (B, Hkv, 1, D), which
    the kernel stores into each row's slot len - 1 (then not stored before the call)."""
    _, Hkv, P, _ = k_pool.shape
    maxp = table.shape[1]
    inputs = [k_pool, v_pool, table.astype(mx.int32), lengths.astype(mx.int32)]
    return _launch("dense", inputs, q, k_pool.dtype, Hkv, P, maxp * P, maxp, scale, [], chunk, new_kv)


def paged_decode_attention_quantized(q: mx.array, packed: list[mx.array], tail_k: mx.array, tail_v: mx.array,
                                     tails: mx.array, table: mx.array, lens: mx.array, scale: float, bits: int,
                                     group_size: int, chunk: int | None = None,
                                     new_kv: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """q (B, Hq, 1, D); packed: [k_w, k_scales, k_biases, v_w, v_scales, v_biases], each
    (pages, Hkv, P, width); tail_k/v (slots, Hkv, P, D); tails (B,) the rows' tail slots;
    table (B, maxp) the sealed pages; lens (B, 2) int32: tokens on sealed pages and in the
    tail (the new token included) -> (B, Hq, 1, D). chunk, new_kv as in paged_decode_attention
    (new_kv: stored into the tail pages)."""
    _, Hkv, P, _ = tail_k.shape
    maxp = table.shape[1]
    inputs = [packed[0], packed[1], packed[2], packed[3], packed[4], packed[5], tail_k, tail_v,
              tails.astype(mx.int32), table.astype(mx.int32), lens.astype(mx.int32)]
    return _launch("quant", inputs, q, tail_k.dtype, Hkv, P, maxp * P + P, maxp, scale,
                   [("BITS", bits), ("GS", group_size)], chunk, new_kv)
