"""Decode attention on MLX's CPU backend, one model's layers in turn (issue 3).

Per shape, four ways to attend one query per row over paged float32 K/V:
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

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/cpu_decode_attention.py [out.json]
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kvbatch.engine.kv.routes import dense as attention  # noqa: E402
from kvbatch.engine.kv.routes import softmax_cpu as softmax  # noqa: E402

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


def median_ms(f, n: int = 30) -> float:
    for _ in range(3):
        mx.eval(f())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def main() -> None:
    mx.set_cache_limit(2 << 30)  # as the engine does (its step workspace): no fresh pages per step
    rng = np.random.default_rng(0)
    rows = []
    print("| shape | layers | batch | Hq/Hkv | context | page | sdpa ms | gathered ms | gathered_poly ms | "
          "in_place ms | in_place / gathered | softmax old / new ms | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, layers, B, Hq, Hkv, D, T, P in SHAPES:
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
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
