"""One layer's decode attention on MLX's CPU backend: dense routes (--kv none, issue 3) and packed q8/q4 pages
gathered vs read in place (--kv q8,q4, issue 5). Merged from cpu_decode_attention.py and
cpu_quant_decode_attention.py.

--kv none: per shape (--shapes: indexes into SHAPES, default all), four ways to attend one query per row over
paged float32 K/V:
- `sdpa`: pages gathered by the page table, then MLX's `scaled_dot_product_attention`
  (a composed fallback on the CPU: one GEMV per query head, K/V re-read per head);
- `gathered`: pages gathered, then kvbatch's grouped form (`_grouped_decode`: each KV
  head's query group folded into one GEMM), with the old softmax (compiled `power(2, x)`);
- `gathered_poly`: the same with kvbatch's polynomial-2^x softmax (engine/kv/routes/softmax_cpu.py);
- `in_place`: kvbatch's decode now (`paged_grouped_decode`: `gather_mm` on the pages where
  they lie, polynomial softmax).
Every layer has its own page buffers (as in a model: the caches do not stay hot), pages
in random order; median of 30 timed evals of all layers after 3 warm-ups, per-layer ms.
Also the softmax alone (old vs new). Max |difference| to `sdpa` is reported.

--kv q8 / q4: each case (--cases BxT) builds a QuantizedStore (keys per channel, page 64, group 64) holding B
rows of T sealed tokens on scattered pages plus a half-full tail page, and times the two routes alternately
(A, B, A, B, ...) so both see the same machine conditions; medians in ms. "split" is the number of CPU streams
the engine's `stream_split` gives the case (both routes use it); --one-stream also forces one; --split-ab K:
in place on 1 stream vs on K instead.

    python -m benchmarks cpu.decode_attention --kv none
    python -m benchmarks cpu.decode_attention --kv q8,q4 --cases 1x2048,4x2048,1x6144,4x6144
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from functools import partial

import mlx.core as mx
import numpy as np

from benchmarks import harness as h
from kvbatch.engine.kv.routes import dense as attention
from kvbatch.engine.kv.routes import quant as att
from kvbatch.engine.kv.routes import softmax_cpu as softmax
from kvbatch.engine.kv.routes.cpu_streams import cpu_streams, stream_split
from kvbatch.engine.kv.store import QuantizedStore

SMOKE = ["--kv", "none,q8,q4", "--shapes", "0", "--layers", "1", "--reps", "2", "--cases", "1x128"]


def add_args(ap) -> None:
    ap.add_argument("--kv", default="none", help="none (the dense routes, SHAPES) and/or q8,q4 (--cases)")
    ap.add_argument("--shapes", default="", help="none: indexes into SHAPES (default: all)")
    ap.add_argument("--layers", type=int, default=0, help="none: layers per shape (0: the shape's)")
    ap.add_argument("--reps", type=int, default=30, help="timed evaluations per measure")
    ap.add_argument("--cases", default="1x2048,4x2048,1x6144,4x6144", help="q8/q4: BxT,...")
    ap.add_argument("--one-stream", action="store_true", help="q8/q4: also each case on one stream")
    ap.add_argument("--split-ab", type=int, default=0, help="q8/q4: instead in place on 1 stream vs on this many")

# (label, layers, batch, query heads, KV heads, head size, context, page size)
SHAPES = [("tiny llama", 4, 8, 4, 2, 64, 200, 16), ("tiny llama", 4, 32, 4, 2, 64, 200, 16),
          ("tiny llama", 4, 32, 4, 2, 64, 200, 64),
          ("SmolLM2", 8, 1, 9, 3, 64, 256, 16), ("SmolLM2", 8, 8, 9, 3, 64, 256, 16),
          ("SmolLM2", 8, 32, 9, 3, 64, 256, 16), ("SmolLM2", 8, 1, 9, 3, 64, 2048, 16),
          ("SmolLM2", 4, 4, 9, 3, 64, 6144, 16), ("SmolLM2", 4, 4, 9, 3, 64, 6144, 64)]


def _old_softmax(scores: mx.array, mask: mx.array) -> mx.array:
    """kvbatch's softmax before engine/kv/routes/softmax_cpu.py: 2^x by mx.power, one compiled kernel."""
    s = mx.where(mask, scores.astype(mx.float32), -mx.inf)
    e = mx.power(2.0, (s - s.max(axis=-1, keepdims=True)) * (1.0 / math.log(2.0)))
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


_old_fused = mx.compile(_old_softmax, shapeless=True)


def dense_shapes(a) -> list[dict]:
    median_ms = partial(h.median_ms, n=a.reps)
    rng = np.random.default_rng(0)
    rows = []
    picked = [SHAPES[int(i)] for i in a.shapes.split(",")] if a.shapes else SHAPES
    print("| shape | layers | batch | Hq/Hkv | context | page | sdpa ms | gathered ms | gathered_poly ms | "
          "in_place ms | in_place / gathered | softmax old / new ms | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, layers, B, Hq, Hkv, D, T, P in picked:
        layers = a.layers or layers
        n = -(-T // P)
        pages = B * n + 8
        kp = [mx.array(rng.standard_normal((pages, Hkv, P, D), dtype=np.float32)) for _ in range(layers)]
        vp = [mx.array(rng.standard_normal((pages, Hkv, P, D), dtype=np.float32)) for _ in range(layers)]
        table = mx.array(rng.permutation(pages)[: B * n].reshape(B, n).astype(np.int32))
        heads = mx.arange(Hkv)[None, :, None]
        page_heads = (table[:, None, :] * Hkv + heads).astype(mx.uint32)
        query_of = mx.arange(B * Hkv, dtype=mx.uint32).reshape(B, Hkv, 1)
        q = mx.array(rng.standard_normal((B, Hq, 1, D), dtype=np.float32))
        lens = mx.array(rng.integers(T - P, T + 1, B))
        mask = (mx.arange(n * P)[None] < lens[:, None]).reshape(B, 1, 1, n * P)
        key_mask = mask.reshape(B, 1, n * P, 1)
        mx.eval(kp, vp, table, page_heads, q, mask)
        scale = D ** -0.5

        def gather(i):
            return (kp[i][table[:, None, :], heads].reshape(B, Hkv, n * P, D),
                    vp[i][table[:, None, :], heads].reshape(B, Hkv, n * P, D))

        def sdpa():
            return [mx.fast.scaled_dot_product_attention(q, *gather(i), scale=scale, mask=mask) for i in range(layers)]

        def gathered(sm):
            def f():
                saved = attention.masked_softmax
                attention.masked_softmax = sm
                try:
                    return [attention._grouped_decode(q, *gather(i), mask, scale) for i in range(layers)]
                finally:
                    attention.masked_softmax = saved
            return f

        def in_place():
            return [attention.paged_grouped_decode(q, kp[i], vp[i], page_heads, query_of, key_mask, scale)
                    for i in range(layers)]

        scores = mx.array(rng.standard_normal((B, Hkv, Hq // Hkv, n * P), dtype=np.float32)) * 10
        ref = sdpa()
        diff = max(mx.abs(a - b).max().item() for f in (gathered(softmax.masked_softmax), in_place)
                   for a, b in zip(ref, f()))
        t = {"sdpa": median_ms(sdpa), "gathered": median_ms(gathered(_old_fused)),
             "gathered_poly": median_ms(gathered(softmax.masked_softmax)), "in_place": median_ms(in_place),
             "softmax_old": median_ms(lambda: [_old_fused(scores, mask) for _ in range(layers)]),
             "softmax_new": median_ms(lambda: [softmax.masked_softmax(scores, mask) for _ in range(layers)])}
        t = {k: v / layers for k, v in t.items()}
        rows.append({"shape": label, "layers": layers, "batch": B, "q_heads": Hq, "kv_heads": Hkv, "context": T,
                     "page_size": P, **{f"{k}_ms": v for k, v in t.items()}, "max_abs_diff": diff})
        print(f"| {label} | {layers} | {B} | {Hq}/{Hkv} | {T} | {P} | {t['sdpa']:.3f} | {t['gathered']:.3f} | "
              f"{t['gathered_poly']:.3f} | {t['in_place']:.3f} | {t['in_place'] / t['gathered']:.2f} | "
              f"{t['softmax_old']:.3f} / {t['softmax_new']:.3f} | {diff:.1e} |", flush=True)
    return rows


def case(B: int, T: int, bits: int, P: int = 64, group: int = 64, H: int = 3, Hq: int = 9, D: int = 64,
         reps: int = 30, streams_max: int | None = None, split_ab: int = 0) -> dict:
    """gathered vs in place at the engine's split; split_ab=k: in place on 1 stream vs on k streams."""
    rng = np.random.default_rng(B * T + bits)
    n = T // P
    n_pages = B * n + 3
    st = QuantizedStore(1, H, D, P, mx.float32, bits, group, tail_slots=B, k_axis="channel")
    st.grow(n_pages)
    k = mx.array(rng.standard_normal((n_pages * P, H, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((n_pages * P, H, D)).astype(np.float32))
    st.store_pages(0, mx.arange(n_pages * P, dtype=mx.int32), k, v)
    st.tk[0] = mx.array(rng.standard_normal(st.tk[0].shape).astype(np.float32))
    st.tv[0] = mx.array(rng.standard_normal(st.tv[0].shape).astype(np.float32))
    mx.eval(st.q[0], st.tk[0], st.tv[0])
    table = mx.array(rng.permutation(n_pages)[:B * n].reshape(B, n).astype(np.int32))
    tails = mx.arange(B, dtype=mx.int32)
    fill = P // 2
    q = mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32))
    scale = D ** -0.5
    streams = cpu_streams(min(os.cpu_count() or 1, 4))  # the CPU route's default
    most = min(len(streams), n) if streams_max is None else streams_max
    split = stream_split(B * H, T, D, most)
    cuts = [n * i // split for i in range(split + 1)]
    # the previous route's plan and inputs
    mask_q = mx.ones((B, 1, 1, T), mx.bool_)
    mask_t = (mx.arange(P) < fill)[None, None, None]
    mask_t = mx.broadcast_to(mask_t, (B, 1, 1, P))
    mask_all = mx.concatenate([mask_q, mask_t], axis=-1)

    def gathered():
        tk, tv = st.gather_tails(0, tails)
        qk = []
        for i, (a, z) in enumerate(zip(cuts, cuts[1:])):
            with mx.stream(streams[i] or mx.default_stream(mx.default_device())):
                qk.append(st.gather_quantized(0, table[:, a:z], "k"))
        return att.quantized_decode_attention(q, qk, st.gather_quantized(0, table, "v"), tk, tv, mask_q, mask_t,
                                              scale, group, bits, streams, k_transposed=True, mask=mask_all)

    # the in-place route's plan
    page_heads = (table[:, None, :] * H + mx.arange(H, dtype=mx.int32)[None, :, None]).astype(mx.uint32)
    query_of = mx.arange(B * H, dtype=mx.uint32).reshape(B, H, 1)
    mask_p = mx.concatenate([mx.broadcast_to(mask_t.reshape(B, 1, 1, 1, P), (B, 1, 1, 1, P)),
                             mx.ones((B, 1, n, 1, P), mx.bool_)], axis=2)
    mx.eval(page_heads, query_of, mask_p, mask_all)

    def in_place(cuts=cuts):
        tk, tv = st.gather_tails(0, tails)
        return att.quantized_paged_decode(q, st.q[0][:3], st.q[0][3:], tk, tv, page_heads, query_of, mask_p, scale,
                                          group, bits, streams, cuts)

    if split_ab:  # A: one stream, B: split_ab streams (both in place)
        split = split_ab
        gathered = in_place  # noqa: F811  (the A side)
        in_place = partial(in_place, cuts=[n * i // split_ab for i in range(split_ab + 1)])

    a, b = gathered(), in_place()
    diff = mx.abs(a - b).max().item()
    for f in (gathered, in_place, gathered, in_place):
        mx.eval(f())
    ta, tb = [], []
    for _ in range(reps):
        for f, ts in ((gathered, ta), (in_place, tb)):
            t = time.perf_counter()
            mx.eval(f())
            ts.append(time.perf_counter() - t)
    ga, gb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    if split_ab:
        return {"batch": B, "context": T, "bits": bits, "in_place_1stream_ms": ga, f"in_place_{split}streams_ms": gb,
                "split_over_1stream": gb / ga, "max_abs_diff": diff}
    return {"batch": B, "context": T, "bits": bits, "split": split, "gathered_ms": ga, "in_place_ms": gb,
            "in_place_over_gathered": gb / ga, "max_abs_diff": diff}


def quant_cases(a, bits_list: list[int]) -> list[dict]:
    rows = []
    for c in a.cases.split(","):
        B, T = map(int, c.split("x"))
        for bits in bits_list:
            for most in ([None, 1] if a.one_stream else [None]):
                r = case(B, T, bits, reps=a.reps, streams_max=most, split_ab=a.split_ab)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
                rows.append(r)
    return rows


def run(a) -> dict:
    mx.set_cache_limit(2 << 30)  # as the engine does (its step workspace): no fresh pages per step
    kinds = a.kv.split(",")
    out = {}
    if "none" in kinds:
        out["dense"] = dense_shapes(a)
    bits = [{"q8": 8, "q4": 4}[k] for k in kinds if k != "none"]
    if bits:
        out["quantized"] = quant_cases(a, bits)
    return out
