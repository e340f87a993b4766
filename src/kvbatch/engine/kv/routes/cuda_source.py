"""CUDA source of the fused paged decode kernels (routes/cuda_kernels.py launches them).

Kept apart from the launch code so the text can be read (and compiled by
benchmarks/gpu/cuda_compile_check.py) on its own. `kernel_source` assembles one kernel body from
the pieces below; MLX's `mx.fast.cuda_kernel` wraps it in the signature and the template
constants (T, S, D, P, REP, HKV, NW, LPT, NE, U; KBITS, VBITS, GS for quantized pages).

Layout of a launch: one block per (row, KV head, split); 8 head elements per lane, LPT lanes
per token, TPW = 32 / LPT tokens per warp and U of them per lane per loop step; the query group
(GQA, REP heads) shares each K/V load; online softmax in float32.
"""
from __future__ import annotations

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
"""

# The block's warps' (max, sum, output) per query slot, from shared memory, merged per (slot, element).
_MERGE_WARPS = r"""    __syncthreads();
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
        {guard}out[{qoff} + d] = static_cast<T>(A / L);
    }}
"""

_WRITE_PART = r"""
        const size_t pr = ((size_t){blk} * ns + sp) * REP + r;
        if (d == 0) {{ pm[pr] = M; pl[pr] = L; }}
        pacc[pr * D + d] = A;
    }}
"""

# The merge of a split row's partials (one block per (row, KV head), or per (row, KV head, position
# chunk) for a verification window).
_REDUCE = r"""
    const int ns = meta[1];
    {index}
    const int len = lens[b] + QL;  // q8/q4: the rows' positions
    const int nr = len > meta[3] ? min(ns, (len + meta[2] - 1) / meta[2]) : 1;  // this row's own splits
    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {{
        const int r = i / D, d = i % D;
        float M = -INFINITY;
        for (int s = 0; s < nr; ++s) M = fmaxf(M, pm[((size_t){blk} * ns + s) * REP + r]);
        float L = 0.f, A = 0.f;
        for (int s = 0; s < nr; ++s) {{
            const size_t pr = ((size_t){blk} * ns + s) * REP + r;
            // weight exactly 1 for the split that holds the max: one split = the unsplit kernel's bits
            const float c = (pm[pr] == M) ? 1.f : (pm[pr] == -INFINITY) ? 0.f : __expf(pm[pr] - M);
            L += pl[pr] * c;
            A += pacc[pr * D + d] * c;
        }}
        {guard}out[{qoff} + d] = static_cast<T>(A / L);
    }}
"""
_REDUCE_INDEX = {False: "const int bh = blockIdx.x, b = bh / HKV;",
                 True: "const int bq = blockIdx.x, bh = bq / NQC, qc = bq % NQC, b = bh / HKV;"}


# Where query slot r's output goes. Decode: one block per (row, KV head), slot r = query head r of
# its group. A window (the tensor-core kernel): one block per (row, KV head, chunk of QC positions),
# slot r = head r / QC at position qc * QC + r % QC of the NL positions of q / out (B, Hq, NL, D); a slot
# past the window (the last chunk of a window not a multiple of QC) writes nothing.
_MREAL = "(qc * QC + r % QC < NL)"
_OUTPUTS = {False: dict(blk="bh", guard="", qoff="((size_t)bh * REP + r) * D"),
            True: dict(blk="bq", guard=f"if {_MREAL} ",
                       qoff="(((size_t)bh * (REP / QC) + r / QC) * NL + qc * QC + r % QC) * D")}


def reduce_source(multi: bool = False) -> str:
    """The merge kernel's body (template constants T, D, REP, HKV, QL; NQC, QC, NL for a window)."""
    return _REDUCE.format(index=_REDUCE_INDEX[multi], **_OUTPUTS[multi])


# q8/q4 pages in the lean loop: a lane's 8 elements share one group's scale s and bias b, so
# q.(s*c + b) = s*(q.c) + b*sum(q) and sum_t p*(s*c + b) = sum_t (p*s)*c + sum_t p*b. The loop
# converts codes to floats and does the dense loop's multiply-adds plus two per (query head,
# token) instead of dequantizing 16 values per token first. `qs` holds sum(q) of the lane's
# elements; `ab` (the bias part of the value sum) is added to acc after the sealed pages.
_FOLD_START = r"""
    float qs[REP], ab[REP];
    for (int r = 0; r < REP; ++r) {
        qs[r] = 0.f;
        ab[r] = 0.f;
        for (int e = 0; e < NE; ++e) qs[r] += qr[r][e];
    }
"""
_FOLD_END = r"""
    for (int r = 0; r < REP; ++r) for (int e = 0; e < NE; ++e) acc[r][e] += ab[r];
"""

# The loop: each lane keeps its tokens' K/V as loaded (bf16 pairs or packed codes: 4 registers a
# token for bf16 K, 2 for q8, 1 for q4, against 8 floats) and converts element e inside the score
# and value loops, where all REP query heads use it at once: the q8/q4 kernels fit in 128
# registers a thread, so two 256-thread blocks share an SM (nvcc -Xptxas -v; docs/performance.md).
_RAW_LOOP = r"""
    {{
        const int ta = {start}, tz = {stop};
        for (int tb = ta + warp * TPW * U; tb < tz; tb += NW * TPW * U) {{
            {decl}
            bool valid[U];
            for (int u = 0; u < U; ++u) {{
                const int t = tb + u * TPW + sub;
                valid[u] = t < tz;
                if (valid[u] && on) {{
                    {load}
                }} else {{
                    {zero}
                }}
            }}
            float x[REP][U];
            for (int r = 0; r < REP; ++r) for (int u = 0; u < U; ++u) x[r][u] = 0.f;
            for (int e = 0; e < NE; ++e) {{
                for (int u = 0; u < U; ++u) {{
                    const float kv = {kconv};
                    for (int r = 0; r < REP; ++r) x[r][u] += qr[r][e] * kv;
                }}
            }}
            for (int r = 0; r < REP; ++r) {{
                float mn = m[r];
                for (int u = 0; u < U; ++u) {{
                    {score}
                    for (int o = LPT / 2; o > 0; o >>= 1) x[r][u] += __shfl_xor_sync(0xffffffff, x[r][u], o);
                    if (valid[u]) mn = fmaxf(mn, x[r][u]);
                }}
                if (mn > m[r]) {{  // rescale only when the running max moves (rarely, once warm)
                    const float corr = __expf(m[r] - mn);
                    l[r] *= corr;
                    for (int e = 0; e < NE; ++e) acc[r][e] *= corr;
                    {rescale}
                    m[r] = mn;
                }}
                for (int u = 0; u < U; ++u) {{  // x becomes the value weight; NaN scores stay NaN
                    const float p = valid[u] ? __expf(x[r][u] - m[r]) : 0.f;
                    l[r] += p;
                    {weight}
                }}
            }}
            for (int e = 0; e < NE; ++e) {{
                for (int u = 0; u < U; ++u) {{
                    const float vv = {vconv};
                    for (int r = 0; r < REP; ++r) acc[r][e] += x[r][u] * vv;
                }}
            }}
        }}
    }}
"""

_RAW_DENSE_LOAD = r"""
                    const int page = table[(size_t)b * maxp + t / P];
                    const size_t base = (((size_t)page * HKV + hk) * P + (t % P)) * D + li * NE;
                    kr[u] = *reinterpret_cast<const V8*>(k + base);
                    vr[u] = *reinterpret_cast<const V8*>(v + base);
"""
_RAW_TAIL_LOAD = r"""
                    const size_t base = (((size_t)tails[b] * HKV + hk) * P + (t - n_main)) * D + li * NE;
                    kr[u] = *reinterpret_cast<const V8*>(tk + base);
                    vr[u] = *reinterpret_cast<const V8*>(tv + base);
"""
_RAW_DENSE = dict(decl="V8 kr[U], vr[U];",
                  zero="for (int e = 0; e < NE; ++e) { kr[u].x[e] = static_cast<S>(0.f); vr[u].x[e] = kr[u].x[e]; }",
                  kconv="static_cast<float>(kr[u].x[e])", vconv="static_cast<float>(vr[u].x[e])",
                  score="", rescale="", weight="x[r][u] = p;")

_RAW_QUANT_LOAD = r"""
                    const int page = table[(size_t)b * maxp + t / P];
                    const size_t slot = ((size_t)page * HKV + hk) * P + (t % P);
                    const size_t go = slot * G + (li * NE) / GS;
                    kr[u] = *reinterpret_cast<const QWK*>(kw + slot * WK + li * WPLK);
                    vr[u] = *reinterpret_cast<const QWV*>(vw + slot * WV + li * WPLV);
                    ksc[u] = static_cast<float>(ks[go]);
                    kbi[u] = static_cast<float>(kb[go]);
                    vsc[u] = static_cast<float>(vs[go]);
                    vbi[u] = static_cast<float>(vb[go]);
"""
# code e of a lane's packed word(s) -> float: 2^23 + code as bits, minus 2^23 (no I2F); {b}: KBITS or
# VBITS (keys and values may be stored at different bits: k8v4)
_CODE = ("(__uint_as_float({b} == 8 ? __byte_perm({w}.x[(e * {b}) / 32], 0x4B000000u, (e % 4) | 0x7440)"
         " : ((({w}.x[(e * {b}) / 32] >> ((e * {b}) % 32)) & 0xFu) | 0x4B000000u)) - 8388608.f)")
_RAW_QUANT = dict(decl="QWK kr[U]; QWV vr[U]; float ksc[U], kbi[U], vsc[U], vbi[U];",
                  zero="for (int w = 0; w < WPLK; ++w) kr[u].x[w] = 0u; for (int w = 0; w < WPLV; ++w) vr[u].x[w] = 0u;"
                       " ksc[u] = 0.f; kbi[u] = 0.f; vsc[u] = 0.f; vbi[u] = 0.f;",
                  kconv=_CODE.format(w="kr[u]", b="KBITS"), vconv=_CODE.format(w="vr[u]", b="VBITS"),
                  score="x[r][u] = x[r][u] * ksc[u] + kbi[u] * qs[r];", rescale="ab[r] *= corr;",
                  weight="ab[r] += p * vbi[u]; x[r][u] = p * vsc[u];")
_QW = r"""
    constexpr int WPLK = NE * KBITS / 32, WK = D * KBITS / 32, WPLV = NE * VBITS / 32, WV = D * VBITS / 32;
    constexpr int G = D / GS;
    struct alignas(4 * WPLK) QWK { uint32_t x[WPLK]; };
    struct alignas(4 * WPLV) QWV { uint32_t x[WPLV]; };
"""


def kernel_source(quantized: bool, split: bool, new_kv: bool = False) -> str:
    """The kernel body. new_kv: the kernel also stores the step's token (inputs kn, vn) into
    its dense page / tail page."""
    k, v = ("tk", "tv") if quantized else ("k", "v")
    load = _RAW_TAIL_LOAD if quantized else _RAW_DENSE_LOAD
    store = ""
    if new_kv:
        base = ("(((size_t)tails[b] * HKV + hk) * P + (tn - n_main)) * D + li * NE" if quantized else
                "(((size_t)table[(size_t)b * maxp + tn / P] * HKV + hk) * P + (tn % P)) * D + li * NE")
        store = _NEW_KV.format(k=k, v=v, base=base)
        load = (load.replace(f"({k} + base)", _NEW_SEL.format(n="kn", p=k))
                .replace(f"({v} + base)", _NEW_SEL.format(n="vn", p=v)))
    if quantized:
        head = _HEAD.format(lens="const int len = pos[b] + 1, n_main = pos[b] - pos[b] % P;")
        sealed = _QW + _FOLD_START + _RAW_LOOP.format(start="t0", stop="min(t1, n_main)", load=_RAW_QUANT_LOAD,
                                                      **_RAW_QUANT) + _FOLD_END
        body = sealed + _RAW_LOOP.format(start="max(t0, n_main)", stop="t1", load=load, **_RAW_DENSE)
    else:
        head = _HEAD.format(lens="const int len = lengths[b];")
        body = _RAW_LOOP.format(start="t0", stop="t1", load=load, **_RAW_DENSE)
    return head + store + body + _MERGE + _MERGE_WARPS + (_WRITE_PART if split else _WRITE_OUT).format(
        **_OUTPUTS[False])


# Decode and verification windows on the tensor cores (bf16/fp16 pages, page size a multiple of 16): a
# block holds REP = (query heads of its KV head) x QC positions (decode: 1) as the 16 rows of
# mma.m16n8k16's A operand
# (rows past REP are zero and never written); each warp takes 16-token tiles of the block's range
# (a tile never crosses a page: it starts at a multiple of 16), computes S = Q K^T from K read in
# place, keeps an online softmax per row in float32 (FlashAttention-2's layout: a lane holds rows g
# and g + 8, columns 2c and 2c + 1 of each 8-column tile), and adds P V with P rounded to the page
# type and V staged in shared memory (tokens past the row's end as zeros: a zero weight times an
# unwritten slot's bits could be NaN). Query slot r sees keys below lim (its position's own count).
# Where the decode-style loop spends a shuffle reduction per (query, token), this spends one mma per
# 8 tokens x 16 element columns for all of the block's queries at once.
# A query's numbers depend on its own row of A, its key count and the block's token range only: keys
# past its count weigh exactly 0, a range with none of its keys merges with weight 0, and the warps
# (NW) depend on the head size alone. So a (row, position) gets the same bits in a decode step and in a
# verification window: speculation keeps decode's tokens.
_MMA_HEAD = r"""
    const int maxp = meta[0], ns = meta[1];
    const int bq = blockIdx.x / ns, sp = blockIdx.x % ns, bh = bq / NQC, qc = bq % NQC;
    const int b = bh / HKV, hk = bh % HKV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    {lens}
    const int chunk = len > meta[3] ? meta[2] : len;
    const int t0 = sp * chunk, t1 = min(len, t0 + chunk);
    if (sp > 0 && t0 >= len) return;
    const float sc = scale[0];
    {store}
    struct alignas(4) T2 { S x, y; };
    auto pack = [](float lo, float hi) -> uint32_t {
        T2 t{static_cast<S>(lo), static_cast<S>(hi)};
        return *reinterpret_cast<uint32_t*>(&t);
    };
    auto mma = [](float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    };
    float o[D / 8][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (int nd = 0; nd < D / 8; ++nd) for (int i = 0; i < 4; ++i) o[nd][i] = 0.f;
    __shared__ __align__(16) S sv[NW][16][D + 8];  // a row stride of D + 8 keeps the fragment reads off one bank
"""

# This lane's query rows g and g + 8 (slots of the block): their key counts and the A operand, page type.
_MMA_Q = r"""
    int lim[2];
    uint32_t qa[D / 16][4];
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h, j = qc * QC + r % QC;
        const bool real = r < REP && j < NL;
        lim[h] = real ? min(first + j + 1, len) : 0;
        const T* qp = q + (real ? (((size_t)bh * (REP / QC) + r / QC) * NL + j) * D : 0);
        for (int kk = 0; kk < D / 16; ++kk) {
            qa[kk][h] = real ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 2 * c) : 0u;
            qa[kk][2 + h] = real ? *reinterpret_cast<const uint32_t*>(qp + kk * 16 + 8 + 2 * c) : 0u;
        }
    }
"""

# The online softmax over a tile's scores s[nt][2h + e] (row g + 8h, token ts + nt * 8 + 2c + e): scores become
# weights, the row's max / sum / output (and {rescale}: other sums kept beside the output) follow.
_MMA_SOFTMAX = r"""
        for (int h = 0; h < 2; ++h) {
            float mx = m[h];
            for (int nt = 0; nt < 2; ++nt) for (int e = 0; e < 2; ++e) {
                const int t = ts + nt * 8 + 2 * c + e;
                const float x = t < lim[h] ? {score} : -INFINITY;
                s[nt][2 * h + e] = x;
                mx = fmaxf(mx, x);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float mu = mx == -INFINITY ? 0.f : mx;
            const float corr = __expf(m[h] - mu);
            l[h] *= corr;
            for (int nd = 0; nd < D / 8; ++nd) { o[nd][2 * h] *= corr; o[nd][2 * h + 1] *= corr; }
            {rescale}
            for (int nt = 0; nt < 2; ++nt) for (int e = 0; e < 2; ++e) {
                const float pv = __expf(s[nt][2 * h + e] - mu);
                s[nt][2 * h + e] = pv;
                l[h] += pv;
            }
            m[h] = mx;
        }
"""

# 16-token tiles of pages in the page type: `base` the tile's first token's K/V offset; output column n of
# column tile nd is head element {col}.
_MMA_TILES = r"""
    for (int ts = {start} + warp * 16; ts < {stop}; ts += NW * 16) {
        const size_t base = {base};
        for (int i = lane; i < 2 * D; i += 32) {  // V tile, 16-byte pieces
            const int row = i / (D / 8), col = (i % (D / 8)) * 8;
            uint4 w = make_uint4(0u, 0u, 0u, 0u);
            if (ts + row < len) w = *reinterpret_cast<const uint4*>({v} + base + (size_t)row * D + col);
            *reinterpret_cast<uint4*>(&sv[warp][row][col]) = w;
        }
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        for (int nt = 0; nt < 2; ++nt) {
            const S* kr = {k} + base + (size_t)(nt * 8 + g) * D + 2 * c;
            for (int kk = 0; kk < D / 16; ++kk)
                mma(s[nt], qa[kk], *reinterpret_cast<const uint32_t*>(kr + kk * 16),
                    *reinterpret_cast<const uint32_t*>(kr + kk * 16 + 8));
        }
{softmax}
        const uint32_t pa[4] = {pack(s[0][0], s[0][1]), pack(s[0][2], s[0][3]), pack(s[1][0], s[1][1]),
                                pack(s[1][2], s[1][3])};
        __syncwarp();
        for (int nd = 0; nd < D / 8; ++nd) {
            const int d = {col};
            mma(o[nd], pa, pack(static_cast<float>(sv[warp][2 * c][d]), static_cast<float>(sv[warp][2 * c + 1][d])),
                pack(static_cast<float>(sv[warp][2 * c + 8][d]), static_cast<float>(sv[warp][2 * c + 9][d])));
        }
        __syncwarp();
    }
"""

# The block's warps' partials into shared memory (_MERGE_WARPS merges them): output column n of column
# tile nd is head element {col}; {extra}(h, nd) is added to it (the q8 value biases' part).
_MMA_END = r"""
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffff, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffff, l[h], 2);
    }
    {reduce_extra}
    __shared__ float sm[NW][REP];
    __shared__ float sl[NW][REP];
    __shared__ float sacc[NW][REP][D];
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        if (r >= REP) continue;
        if (c == 0) { sm[warp][r] = m[h]; sl[warp][r] = l[h]; }
        for (int nd = 0; nd < D / 8; ++nd) for (int e = 0; e < 2; ++e) {
            const int n = 2 * c + e;
            sacc[warp][r][{col}] = o[nd][2 * h + e]{extra};
        }
    }
"""

_STANDARD_COL = "nd * 8 + {n}"


def _tiles(start: str, stop: str, base: str, k: str, v: str, col: str, rescale: str = "") -> str:
    softmax = _MMA_SOFTMAX.replace("{score}", "s[nt][2 * h + e] * sc").replace("{rescale}", rescale)
    return (_MMA_TILES.replace("{start}", start).replace("{stop}", stop).replace("{base}", base)
            .replace("{k}", k).replace("{v}", v).replace("{col}", col.format(n="g")).replace("{softmax}", softmax))


# Decode and verification windows on the tensor cores (bf16/fp16 pages, page size a multiple of 16): a
# block holds REP = (query heads of its KV head) x QC positions (decode: 1) as the 16 rows of
# mma.m16n8k16's A operand
# (rows past REP are zero and never written); each warp takes 16-token tiles of the block's range
# (a tile never crosses a page: it starts at a multiple of 16), computes S = Q K^T from K read in
# place, keeps an online softmax per row in float32 (FlashAttention-2's layout: a lane holds rows g
# and g + 8, columns 2c and 2c + 1 of each 8-column tile), and adds P V with P rounded to the page
# type and V staged in shared memory (tokens past the row's end as zeros: a zero weight times an
# unwritten slot's bits could be NaN). Query slot r sees keys below lim (its position's own count).
# Where the decode-style loop spends a shuffle reduction per (query, token), this spends one mma per
# 8 tokens x 16 element columns for all of the block's queries at once.
# A query's numbers depend on its own row of A, its key count and the block's token range only: keys
# past its count weigh exactly 0, a range with none of its keys merges with weight 0, and the warps
# (NW) depend on the head size alone. So a (row, position) gets the same bits in a decode step and in a
# verification window: speculation keeps decode's tokens.
_MMA_DENSE = (_MMA_HEAD.replace("{lens}", "const int len = lengths[b], first = {first};") + _MMA_Q
              + _tiles("t0", "t1", "(((size_t)table[(size_t)b * maxp + ts / P] * HKV + hk) * P + ts % P) * D",
                       "k", "v", _STANDARD_COL)
              + _MMA_END.replace("{reduce_extra}", "").replace("{col}", _STANDARD_COL.format(n="n"))
              .replace("{extra}", ""))


# Decode's new token (`new_kv`, inputs kn / vn (B, HKV, D)): the block whose range holds it stores it into
# its slot ({dst}: a page slot, or the q8 row's tail slot) before any warp reads its tile (the barrier; no
# other block of the launch reads that slot).
_MMA_STORE = r"""
    if (t0 <= len - 1 && len - 1 < t1) {
        const size_t dst = {dst};
        const size_t src = ((size_t)b * HKV + hk) * D;
        for (int i = threadIdx.x; i < D / 4; i += blockDim.x) {  // K then V, 16-byte pieces
            const int col = (i % (D / 8)) * 8;
            const S* from = (i < D / 8 ? kn : vn) + src + col;
            S* to = const_cast<S*>(i < D / 8 ? {k} : {v}) + dst + col;
            *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
        }
    }
    __syncthreads();
"""
_DENSE_DST = "(((size_t)table[(size_t)b * maxp + (len - 1) / P] * HKV + hk) * P + (len - 1) % P) * D"
_TAIL_DST = "(((size_t)tails[b] * HKV + hk) * P + (len - 1 - n_main)) * D"


def mma_source(split: bool, half: bool, window: bool, new_kv: bool = False) -> str:
    """The tensor-core kernel's body (template constants S, T, D, P, REP, HKV, NW, NL, QC, NQC); half: fp16
    pages, else bf16; window: row b's queries start at firsts[b] (else decode: one query, at len - 1);
    new_kv: decode stores its token (kn, vn) first."""
    assert not (window and new_kv), "a window's K/V are stored by its pass before it attends"
    store = _MMA_STORE.replace("{dst}", _DENSE_DST).replace("{k}", "k").replace("{v}", "v") if new_kv else ""
    body = (_MMA_DENSE.replace("{ty}", "f16" if half else "bf16")
            .replace("{first}", "firsts[b]" if window else "len - 1").replace("{store}", store))
    return body + _MERGE_WARPS + (_WRITE_PART if split else _WRITE_OUT).format(**_OUTPUTS[True])


# q8 decode on the tensor cores: sealed pages' codes enter fp16 mma.m16n8k16 as exact integers (a byte c
# placed under fp16 1024.0's exponent is 1024 + c; one packed subtraction leaves c), and each group's scale and
# bias are folded in around the products as in the decode-style kernel (q.(s*c + b) = s*(q.c) + b*sum(q);
# sum_t p*(s*c + b) = sum_t (p*s)*c + sum_t p*b), so no element is dequantized. The query enters as fp16
# (scaled by the softmax scale, clamped to fp16's range), the value weights p*s too. The order of the head's
# elements is free in both products, so each lane reads its codes as whole words:
# - scores: step kk of the 16 k-steps of group gi = kk / KPG takes, from lane c, the word of bytes
#   gi*GS + c*GS/4 + (kk % KPG)*4 .. +3 of token g (KPG words of a group in one load); the query's A
#   fragment is laid out alike;
# - values: output column n of column tile nd is element gi*GS + n*NPG + nd % NPG (gi = nd / NPG), so lane g
#   reads NPG contiguous bytes of each of its four tokens per group (the B operand's k = tokens 2c, 2c + 1,
#   2c + 8, 2c + 9 of the tile), and each column tile stays in one group (one A operand p*s a group).
# The row's tail page (full precision) follows as the dense kernel's tiles, in its column order.
# Template constants as the dense kernel's plus KBITS = VBITS = 8 and GS (32, 64 or 128).
_QCOL = "(nd / NPG) * GS + {n} * NPG + nd % NPG"
_MMA_Q8 = r"""
    constexpr int G = D / GS, KPG = GS / 16, NPG = GS / 8;
    struct alignas(4 * KPG) KW { uint32_t x[KPG]; };
    struct alignas(NPG) VW { uint32_t x[NPG / 4]; };
    auto mma16 = [](float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    };
    auto f16x2 = [](float lo, float hi) -> uint32_t {
        uint32_t r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    };
    auto codes = [](uint32_t w, uint32_t sel) -> uint32_t {  // two bytes of w (sel) -> two fp16 integers
        uint32_t r, x = __byte_perm(w, 0x64646464u, sel);
        asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0x64006400u));
        return r;
    };
    float ab[2][G];
    for (int h = 0; h < 2; ++h) for (int gi = 0; gi < G; ++gi) ab[h][gi] = 0.f;
    {
        int lim[2];
        uint32_t qh[D / 16][4];
        float qs[2][G];
        for (int h = 0; h < 2; ++h) {
            const int r = g + 8 * h;
            const bool real = r < REP;
            lim[h] = real ? len : 0;
            const T* qp = q + (real ? ((size_t)bh * REP + r) * D : 0);
            auto qf = [&](int d) {  // within fp16's range
                return real ? fminf(fmaxf(static_cast<float>(qp[d]) * sc, -65504.f), 65504.f) : 0.f;
            };
            for (int gi = 0; gi < G; ++gi) {
                float sum = 0.f;
                for (int e = 0; e < GS; ++e) sum += __half2float(__float2half_rn(qf(gi * GS + e)));
                qs[h][gi] = sum;
            }
            for (int kk = 0; kk < D / 16; ++kk) {
                const int d0 = (kk / KPG) * GS + c * (GS / 4) + (kk % KPG) * 4;
                qh[kk][h] = f16x2(qf(d0), qf(d0 + 2));
                qh[kk][2 + h] = f16x2(qf(d0 + 1), qf(d0 + 3));
            }
        }
        for (int ts = t0 + warp * 16; ts < min(t1, n_main); ts += NW * 16) {
            const size_t slot0 = ((size_t)table[(size_t)b * maxp + ts / P] * HKV + hk) * P + ts % P;
            float s[2][4];
            for (int nt = 0; nt < 2; ++nt) {
                float sg[G][4];
                for (int gi = 0; gi < G; ++gi) {
                    for (int i = 0; i < 4; ++i) sg[gi][i] = 0.f;
                    const KW w = *reinterpret_cast<const KW*>(kw + (slot0 + nt * 8 + g) * (D / 4) + gi * (GS / 4)
                                                              + c * KPG);
                    for (int j = 0; j < KPG; ++j)
                        mma16(sg[gi], qh[gi * KPG + j], codes(w.x[j], 0x5250u), codes(w.x[j], 0x5351u));
                }
                for (int e = 0; e < 2; ++e) {  // this lane's score columns: tokens nt * 8 + 2c + e
                    const size_t st = (slot0 + nt * 8 + 2 * c + e) * G;
                    for (int h = 0; h < 2; ++h) {
                        float x = 0.f;
                        for (int gi = 0; gi < G; ++gi)
                            x += static_cast<float>(ks[st + gi]) * sg[gi][2 * h + e]
                                 + static_cast<float>(kb[st + gi]) * qs[h][gi];
                        s[nt][2 * h + e] = x;
                    }
                }
            }
{softmax}
            const size_t s0 = slot0 + 2 * c;  // the B operand's tokens: 2c, 2c + 1, 2c + 8, 2c + 9
            for (int gi = 0; gi < G; ++gi) {
                auto at = [&](const T* a, size_t t) { return static_cast<float>(a[t * G + gi]); };
                const float v0 = at(vs, s0), v1 = at(vs, s0 + 1), v2 = at(vs, s0 + 8), v3 = at(vs, s0 + 9);
                const uint32_t pa[4] = {f16x2(s[0][0] * v0, s[0][1] * v1), f16x2(s[0][2] * v0, s[0][3] * v1),
                                        f16x2(s[1][0] * v2, s[1][1] * v3), f16x2(s[1][2] * v2, s[1][3] * v3)};
                const float b0 = at(vb, s0), b1 = at(vb, s0 + 1), b2 = at(vb, s0 + 8), b3 = at(vb, s0 + 9);
                ab[0][gi] += s[0][0] * b0 + s[0][1] * b1 + s[1][0] * b2 + s[1][1] * b3;
                ab[1][gi] += s[0][2] * b0 + s[0][3] * b1 + s[1][2] * b2 + s[1][3] * b3;
                const size_t wo = gi * (GS / 4) + g * (NPG / 4);
                const VW w0 = *reinterpret_cast<const VW*>(vw + s0 * (D / 4) + wo);
                const VW w1 = *reinterpret_cast<const VW*>(vw + (s0 + 1) * (D / 4) + wo);
                const VW w2 = *reinterpret_cast<const VW*>(vw + (s0 + 8) * (D / 4) + wo);
                const VW w3 = *reinterpret_cast<const VW*>(vw + (s0 + 9) * (D / 4) + wo);
                for (int jn = 0; jn < NPG; jn += 2) {  // column tiles gi * NPG + jn and + 1: bytes jn, jn + 1
                    const uint32_t sel = jn % 4 ? 0x7362u : 0x5140u;  // (token a, token b) of both bytes
                    const uint32_t x01 = __byte_perm(w0.x[jn / 4], w1.x[jn / 4], sel);
                    const uint32_t x23 = __byte_perm(w2.x[jn / 4], w3.x[jn / 4], sel);
                    mma16(o[gi * NPG + jn], pa, codes(x01, 0x4140u), codes(x23, 0x4140u));
                    mma16(o[gi * NPG + jn + 1], pa, codes(x01, 0x4342u), codes(x23, 0x4342u));
                }
            }
        }
    }
    {
        const int first = len - 1;
"""


def mma_quant_source(split: bool, half: bool, new_kv: bool = False) -> str:
    """The q8 tensor-core decode kernel's body (template constants of mma_source's decode, plus KBITS, VBITS
    (both 8) and GS); half: fp16 tail pages and queries, else bf16; new_kv: it stores its token (kn, vn) in
    the row's tail page first."""
    store = _MMA_STORE.replace("{dst}", _TAIL_DST).replace("{k}", "tk").replace("{v}", "tv") if new_kv else ""
    rescale = "for (int gi = 0; gi < G; ++gi) ab[h][gi] *= corr;"  # the value biases' sum, as the output
    softmax = _MMA_SOFTMAX.replace("{score}", "s[nt][2 * h + e]").replace("{rescale}", rescale)
    tail = _tiles("max(t0, n_main)", "t1", "(((size_t)tails[b] * HKV + hk) * P + ts - n_main) * D", "tk", "tv",
                  _QCOL, rescale)
    end = (_MMA_END.replace("{reduce_extra}", "for (int h = 0; h < 2; ++h) for (int gi = 0; gi < G; ++gi) {\n"
                            "        ab[h][gi] += __shfl_xor_sync(0xffffffff, ab[h][gi], 1);\n"
                            "        ab[h][gi] += __shfl_xor_sync(0xffffffff, ab[h][gi], 2);\n    }")
           .replace("{col}", _QCOL.format(n="n")).replace("{extra}", " + ab[h][nd / NPG]"))
    body = (_MMA_HEAD.replace("{lens}", "const int len = pos[b] + 1, n_main = pos[b] - pos[b] % P;")
            + _MMA_Q8.replace("{softmax}", softmax) + _MMA_Q + tail + "    }\n" + end)
    body = body.replace("{ty}", "f16" if half else "bf16").replace("{store}", store)
    return body + _MERGE_WARPS + (_WRITE_PART if split else _WRITE_OUT).format(**_OUTPUTS[True])


# Sealing a q8/q4 decode step's filled tail pages, after the decode kernel stored their last tokens
# (kernel_writes). One thread quantizes one group of GS elements of one token of one KV head, keys (the first half
# of the threads, KBITS) or values (VBITS), of a row whose tail fills this step (its position pos[n] at the page's
# last slot), from tail page tails[n] into the row's page at that position (its page table, `table`, meta[2] pages
# wide), with MLX's affine quantization (mlx/backend/cuda/quantized/affine_quantize.cu: the same min / max, scale,
# edge and rounding steps, so a page sealed here holds the bits mx.quantize gives it in prefill). The pool's
# arrays are written in place through the input pointers, as the decode kernel stores its token. The launch also
# passes the layer's attention output through (a -> o): that makes the seal part of the step's graph, ordered
# after the decode kernel, at no other cost. Template constants: T (the tails', scales' and biases' dtype), HKV,
# P, D, GS, KBITS, VBITS.
SEAL = r"""
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    const size_t n_out = meta[0];
    for (size_t e = i; e < n_out; e += stride) o[e] = a[e];
    constexpr int G = D / GS;
    const size_t work = (size_t)meta[1] * HKV * P * G;
    if (i >= 2 * work) return;
    const bool is_v = i >= work;
    size_t r = is_v ? i - work : i;
    const int g = r % G; r /= G;
    const int t = r % P; r /= P;
    const int h = r % HKV;
    const int n = r / HKV;
    const int p = pos[n];
    if (p % P != P - 1) return;  // a row whose tail does not fill this step
    const int page = table[(size_t)n * meta[2] + p / P];  // the row's page at its position
    const int bits = is_v ? VBITS : KBITS;
    const T* src = (is_v ? tv : tk) + (((size_t)tails[n] * HKV + h) * P + t) * D + g * GS;
    float lo = 3.402823466e+38f, hi = 0.f;  // as MLX: the max starts at 0
    for (int e = 0; e < GS; ++e) {
        const float x = static_cast<float>(src[e]);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    const float n_bins = (float)((1 << bits) - 1);
    float sc = fmaxf((hi - lo) / n_bins, 1e-7f);
    const bool side = fabsf(lo) > fabsf(hi);
    sc = side ? sc : -sc;
    const float edge = side ? lo : hi;
    const float q0 = roundf(edge / sc);
    const bool at_zero = q0 == 0.0f;
    sc = at_zero ? sc : edge / q0;
    const float bias = at_zero ? 0.f : edge;
    const size_t dst = ((size_t)page * HKV + h) * P + t;  // (page, head, token) of the pool
    const_cast<T*>(is_v ? vs : ks)[dst * G + g] = static_cast<T>(sc);
    const_cast<T*>(is_v ? vb : kb)[dst * G + g] = static_cast<T>(bias);
    const int per = 32 / bits;  // codes a uint32 word, the first in the lowest bits
    uint32_t* w = const_cast<uint32_t*>(is_v ? vw : kw) + dst * (D * bits / 32) + g * (GS * bits / 32);
    for (int wd = 0; wd < GS / per; ++wd) {
        uint32_t word = 0;
        for (int j = 0; j < per; ++j) {
            const float c = fminf(roundf((static_cast<float>(src[wd * per + j]) - bias) / sc), n_bins);
            word |= (uint32_t)c << (bits * j);  // c in [0, n_bins]
        }
        w[wd] = word;
    }
"""
