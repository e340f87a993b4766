"""Decode attention on MLX's CPU backend: MLX's SDPA vs kvbatch's grouped (folded) form (issue 3).

MLX's CPU `scaled_dot_product_attention` is a composed fallback: for grouped-query
attention it broadcasts K/V over each KV head's query group, so the matmuls run one
GEMV per query head and read each K/V head `Hq/Hkv` times. kvbatch's CPU decode
(`engine.attention._grouped_decode`) folds the group into the rows of one GEMM per
(row, KV head). Same inputs, float32, median of 30 timed calls after 3 warm-ups, both
forms interleaved per shape; max |difference| of the outputs is reported.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/cpu_decode_attention.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from engine.attention import _grouped_decode  # noqa: E402

# (label, batch, query heads, KV heads, head size, context)
SHAPES = [("tiny llama", 8, 4, 2, 64, 192), ("tiny llama", 32, 4, 2, 64, 192),
          ("SmolLM2", 1, 9, 3, 64, 256), ("SmolLM2", 8, 9, 3, 64, 256), ("SmolLM2", 32, 9, 3, 64, 256),
          ("SmolLM2", 1, 9, 3, 64, 2048), ("SmolLM2", 4, 9, 3, 64, 6144)]


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
    rows = []
    print("| shape | batch | Hq/Hkv | context | MLX SDPA ms | grouped ms | ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for label, B, Hq, Hkv, D, T in SHAPES:
        q = mx.random.normal((B, Hq, 1, D))
        k, v = mx.random.normal((B, Hkv, T, D)), mx.random.normal((B, Hkv, T, D))
        lens = mx.random.randint(T // 2, T + 1, (B,))
        mask = (mx.arange(T)[None] < lens[:, None]).reshape(B, 1, 1, T)
        scale = D ** -0.5
        sdpa = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # noqa: E731
        grouped = lambda: _grouped_decode(q, k, v, mask, scale)  # noqa: E731
        diff = mx.abs(sdpa() - grouped()).max().item()
        a, b = median_ms(sdpa), median_ms(grouped)
        rows.append({"shape": label, "batch": B, "q_heads": Hq, "kv_heads": Hkv, "context": T,
                     "sdpa_ms": a, "grouped_ms": b, "max_abs_diff": diff})
        print(f"| {label} | {B} | {Hq}/{Hkv} | {T} | {a:.3f} | {b:.3f} | {b / a:.2f} | {diff:.1e} |", flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
