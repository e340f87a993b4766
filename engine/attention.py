"""Attention over paged K/V, and the hook that routes mlx-lm models to it.

Routes (reported per row and in summary.json):
- `paged_sdpa`: pages gathered, then MLX's fast SDPA with a padding+causal mask. CPU
  decode instead folds each KV head's query group into one matmul (`_grouped_decode`),
  reads float32 pages of at least 16 tokens in place (`paged_grouped_decode`), and
  uses a fused polynomial-2^x masked softmax (engine/softmax.py).
- `paged_sdpa_f32`: the same with q/k/v upcast to float32 (fp16 models: scores can
  exceed fp16 range, and MLX's CPU fallback computes q·kᵀ in the input dtype).
- `paged_cuda_kernel` (MLX CUDA, kv none): decode reads each row's pages in place with
  a fused kernel (engine/cuda_attention.py), float32 softmax; prefill as `paged_sdpa`.
- `paged_cuda_qkernel` (MLX CUDA, q8/q4): decode reads each row's packed pages and its
  dense tail page in place with a fused kernel, dequantizing in registers, float32
  softmax (engine/cuda_attention.py); prefill as `paged_qmm_f32`.
- `paged_qmm_f32`: quantized pages. Decode runs `mx.quantized_matmul` on the packed
  pages (never dequantizing the prefix) plus a float32 matmul on the row's dense
  tail page; scores and softmax in float32 (on the CPU the quantized matmuls are
  spread over the cores, see `qmm_streams`). CPU decode with float32 stores reads
  the packed pages in place instead (`quantized_paged_decode`,
  `mx.gather_qmm`; KVBATCH_Q_IN_PLACE=0 gathers them). Prefill dequantizes the
  row's pages once per chunk and attends in float32.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine.softmax import masked_softmax

ROUTE_DENSE = "paged_sdpa"
ROUTE_DENSE_F32 = "paged_sdpa_f32"
ROUTE_QMM = "paged_qmm_f32"
ROUTE_CUDA = "paged_cuda_kernel"
ROUTE_CUDA_Q = "paged_cuda_qkernel"


def dense_attention(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float,
                    upcast: bool) -> mx.array:
    """q (B,Hq,L,D); k, v (B,Hkv,T,D); mask bool (B,1,L,T)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)
    if q.shape[2] == 1 and on_cpu():
        out = _grouped_decode(q, k, v, mask, scale)
    else:
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.astype(dtype)


def on_cpu() -> bool:
    """MLX's default device is the CPU (its SDPA is a composed fallback there)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _grouped_decode(q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float) -> mx.array:
    """One-query attention with each KV head's query group folded into the rows of one matmul.

    MLX's CPU SDPA (a composed fallback) broadcasts K/V over the group: one GEMV per query
    head, reading each KV head's K and V once per query head. Folded, it is one small GEMM
    per (row, KV head) that reads them once: 30-37% less attention time at SmolLM2 and
    tiny-llama shapes, bit-identical results (benchmarks/RESULTS.md, issue 3)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qf = (q * mx.array(scale, q.dtype)).reshape(B, Hkv, Hq // Hkv, D)
    scores = qf @ k.swapaxes(-1, -2)  # (B, Hkv, rep, T)
    probs = masked_softmax(scores, mask)
    return (probs @ v).reshape(B, Hq, 1, D)


# Smallest page (tokens) for which decode reads the pages in place (`paged_grouped_decode`):
# it runs two small matmuls per (row, KV head, page), so tiny pages would mean many tiny ones.
IN_PLACE_MIN_PAGE = 16


def paged_grouped_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, page_heads: mx.array,
                         query_of: mx.array, mask: mx.array, scale: float) -> mx.array:
    """`_grouped_decode` read from the pages in place: no gathered copy of K/V.

    q (B, Hq, 1, D); k_pages, v_pages (pages, Hkv, P, D); page_heads (B, Hkv, n): the
    (page * Hkv + head) of each row's n pages; query_of (B, Hkv, 1): b * Hkv + head;
    mask (B, 1, n * P, 1). `mx.gather_mm` multiplies each page where it lies by its
    (row, KV head)'s query group: scores come out key-major, (B, Hkv, n * P, G), so
    the softmax runs down the keys axis and neither product needs a transposed copy.
    On the CPU a page-table gather copies K and V at ~10 GB/s before attention can
    read them; in place, decode attention takes 0.35-0.8x the time at tiny-llama and
    SmolLM2 shapes (benchmarks/RESULTS.md, issue 3). Same float32 softmax; the output
    sums the pages' partial products (within 1e-6 of the gathered path)."""
    B, Hq, _, D = q.shape
    _, Hkv, P, _ = k_pages.shape
    G, n = Hq // Hkv, page_heads.shape[-1]
    qt = q.reshape(B * Hkv, G, D).swapaxes(-1, -2)  # (B*Hkv, D, G), a view
    scores = mx.gather_mm(k_pages.reshape(-1, P, D), qt, page_heads, query_of)  # (B, Hkv, n, P, G)
    probs = masked_softmax(scores.reshape(B, Hkv, n * P, G), mask, axis=-2, scale=scale)  # scaled in the kernel
    pt = probs.reshape(B * Hkv * n, P, G).swapaxes(-1, -2)  # (.., G, P), a view
    out = mx.gather_mm(pt, v_pages.reshape(-1, P, D), None, page_heads.reshape(-1))  # (B*Hkv*n, G, D)
    return out.reshape(B, Hkv, n, G, D).sum(axis=2).reshape(B, Hq, 1, D)


# Quantized matmuls on MLX's CPU backend run on one thread per stream; decode spreads them
# over this many CPU streams (one thread each). KVBATCH_QMM_THREADS overrides; 1 = off.
# A stream is worth its hand-off from this many quantized K (or V) elements on (row, KV head,
# token, channel): SmolLM2's layer at 2k tokens, batch 1 (393k) ran slower split in two,
# at 6k batch 1 (1.2M) and 2k batch 4 (1.6M) 1.2-1.8x faster (benchmarks/RESULTS.md, issue 5).
QMM_MIN_WORK = 1 << 19


def qmm_split(rows_heads: int, tokens: int, head_dim: int, most: int) -> int:
    """How many streams a quantized matmul over rows_heads x tokens x head_dim elements uses."""
    return max(1, min(most, rows_heads * tokens * head_dim // QMM_MIN_WORK))


_qmm_streams: list | None = None


def qmm_streams() -> list:
    """Streams for the quantized matmuls of decode: None (the caller's default stream) first,
    then extra CPU streams on the CPU backend; just [None] on a GPU or with one core."""
    global _qmm_streams
    if _qmm_streams is None:
        n = 1
        if mx.default_device().type == mx.DeviceType.cpu:
            env = os.environ.get("KVBATCH_QMM_THREADS", "").strip()
            n = int(env) if env else min(os.cpu_count() or 1, 4)
        _qmm_streams = [None] + [mx.new_stream(mx.cpu) for _ in range(max(n, 1) - 1)]
    return _qmm_streams


def _f32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def quantized_decode_attention(q: mx.array, qk: list[mx.array] | list[list[mx.array]] | None,
                               qv: list[mx.array], tk: mx.array, tv: mx.array, mask_q: mx.array,
                               mask_t: mx.array, scale: float, group_size: int, bits: int,
                               streams: list | None = None, k_transposed: bool = False,
                               mask: mx.array | None = None) -> mx.array:
    """q (B,Hq,L,D); qk/qv packed triplets (B,Hkv,Tq,·) or None; tail tk/tv (B,Hkv,P,D).

    qk may also be a list of triplets, consecutive runs of pages that together make Tq
    (the key scores of run i are computed on streams[i]). mask_q (B,1,1,Tq) and mask_t
    (B,1,1,P) mark the valid keys (the same for every query of the pass). Queries of a
    KV head's group are folded into rows, (B, Hkv, rep*L, D): the 4-D shape that MLX's
    CUDA quantized_matmul implements for every head size (a 5-D broadcast shape has no
    CUDA kernel at head size 64).

    mask: mask_q and mask_t concatenated, if the caller has it (built once per step, not per layer).

    k_transposed: qk holds K^T quantized per channel, (B,Hkv,D,·) (QuantizedStore
    k_axis="channel"): the scores run as an untransposed quantized_matmul.

    With several streams the work splits so that no sum changes order: key scores by
    token runs (each score is its own dot product), value sums by (row, KV head). So a
    row's output is bit-identical however its batch is split.
    """
    B, Hq, L, D = q.shape
    Hkv = tk.shape[1]
    rep = Hq // Hkv
    dtype = q.dtype
    streams = streams or [None]
    qf = (_f32(q) * scale).reshape(B, Hkv, rep * L, D)
    scores_t = qf @ _f32(tk).swapaxes(-1, -2)  # (B,Hkv,rep*L,P)
    parts, masks = [scores_t], [mask_t]
    if qk is not None:
        runs = qk if isinstance(qk[0], (list, tuple)) else [qk]
        scores_q = [mx.quantized_matmul(qf, w, _f32(s), _f32(b), transpose=not k_transposed, group_size=group_size,
                                        bits=bits, stream=streams[i % len(streams)])
                    for i, (w, s, b) in enumerate(runs)]
        parts[:0] = scores_q
        masks.insert(0, mask_q)
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    if mask is None:
        mask = mx.concatenate(masks, axis=-1) if len(masks) > 1 else masks[0]
    probs = masked_softmax(scores, mask)
    P = tk.shape[2]
    out = probs[..., -P:] @ _f32(tv)
    if qk is not None:
        w, s, b = (a.reshape(B * Hkv, *a.shape[2:]) for a in qv)
        s, b = _f32(s), _f32(b)
        pq = probs[..., :-P].reshape(B * Hkv, rep * L, -1)
        n = qmm_split(B * Hkv, pq.shape[-1], D, min(len(streams), B * Hkv))
        cuts = [B * Hkv * i // n for i in range(n + 1)]
        pv = [mx.quantized_matmul(pq[a:z], w[a:z], s[a:z], b[a:z], transpose=False, group_size=group_size,
                                  bits=bits, stream=streams[i]) for i, (a, z) in enumerate(zip(cuts, cuts[1:]))]
        out = out + (mx.concatenate(pv) if n > 1 else pv[0]).reshape(B, Hkv, rep * L, D)
    out = out.reshape(B, Hq, L, D)
    return out if out.dtype == dtype else out.astype(dtype)


def quantized_paged_decode(q: mx.array, kq: list[mx.array], vq: list[mx.array], tk: mx.array, tv: mx.array,
                           page_heads: mx.array, query_of: mx.array, mask: mx.array, scale: float,
                           group_size: int, bits: int, streams: list | None = None,
                           cuts: list[int] | None = None, k_transposed: bool = True) -> mx.array:
    """`quantized_decode_attention` read from the packed pages in place (CPU, float32 stores).

    q (B, Hq, 1, D); kq: the layer's K pool triplet, K^T pages (pages, Hkv, D, ·) quantized
    per channel (k_transposed, QuantizedStore k_axis="channel") or K pages (pages, Hkv, P, ·)
    quantized per token; vq: its V triplet, (pages, Hkv, P, ·);
    tk, tv (B, Hkv, P, D): the rows' dense tail pages; page_heads (B, Hkv, n): the
    (page * Hkv + head) of each row's sealed pages; query_of (B, Hkv, 1): b * Hkv + head;
    mask (B, 1, 1 + n, 1, P): the tail's valid keys, then the sealed pages'.

    `mx.gather_qmm` multiplies each packed page where it lies by its (row, KV head)'s query
    group: no page-table gather of the packed K/V (and no K^T transpose copy). Scores come
    out page by page, (B, Hkv, 1 + n, G, P) with the tail first; the softmax runs over the
    (page, token) axes, and the values are a second gather_qmm per page, summed over pages.

    cuts: page boundaries of runs computed on streams[i] (key scores and value products
    alike); every run's pages are concatenated before the one sum over pages, so a row's
    output is bit-identical however the work is split, and padded (masked) pages add
    exact zeros.
    """
    B, Hq, _, D = q.shape
    Hkv, P = tk.shape[1], tk.shape[2]
    G, n = Hq // Hkv, page_heads.shape[-1]
    streams = streams or [None]
    runs = list(zip(cuts, cuts[1:])) if cuts else [(0, n)]
    qf = _f32(q).reshape(B * Hkv, G, D)
    kw, ks, kb = (a.reshape(-1, *a.shape[2:]) for a in kq)
    vw, vs, vb = (a.reshape(-1, *a.shape[2:]) for a in vq)
    parts = [(qf.reshape(B, Hkv, G, D) @ _f32(tk).swapaxes(-1, -2))[:, :, None]]  # the tail, (B,Hkv,1,G,P)
    parts += [mx.gather_qmm(qf, kw, ks, kb, lhs_indices=query_of, rhs_indices=page_heads[..., a:z],
                            transpose=not k_transposed,
                            group_size=group_size, bits=bits, stream=streams[i % len(streams)])
              for i, (a, z) in enumerate(runs)]  # (B, Hkv, z - a, G, P) each
    probs = masked_softmax(mx.concatenate(parts, axis=2), mask, axis=(2, 4), scale=scale)
    out = probs[:, :, 0] @ _f32(tv)  # (B, Hkv, G, D)
    pv = [mx.gather_qmm(probs[:, :, 1 + a:1 + z], vw, vs, vb, rhs_indices=page_heads[..., a:z], transpose=False,
                        group_size=group_size, bits=bits, stream=streams[i % len(streams)])
          for i, (a, z) in enumerate(runs)]  # (B, Hkv, z - a, G, D) each
    out = out + (mx.concatenate(pv, axis=2) if len(pv) > 1 else pv[0]).sum(axis=2)
    out = out.reshape(B, Hq, 1, D)
    return out if out.dtype == q.dtype else out.astype(q.dtype)


def install(model: nn.Module) -> None:
    """Route the model module's `scaled_dot_product_attention` to paged caches.

    mlx-lm model files import the function from `.base` into their own module, so
    patching that module's name routes every attention call of the model; calls
    with any other cache (or none) go to the original function unchanged.
    """
    for mod_name in {type(model).__module__, type(getattr(model, "model", model)).__module__}:
        mod = sys.modules.get(mod_name)
        if mod is None or not hasattr(mod, "scaled_dot_product_attention"):
            continue
        original = mod.scaled_dot_product_attention
        if getattr(original, "_kvbatch_paged", False):
            continue
        mod.scaled_dot_product_attention = _make_dispatch(original)


def _make_dispatch(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache: Any, scale: float, mask=None, sinks=None):
        attend = getattr(cache, "paged_attend", None)
        if attend is not None:
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported by the paged cache")
            return attend(queries, scale)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._kvbatch_paged = True
    return scaled_dot_product_attention


def model_supports_paging(model: nn.Module) -> bool:
    mod = sys.modules.get(type(model).__module__)
    return mod is not None and hasattr(mod, "scaled_dot_product_attention")
