"""What the pieces of a verification pass cost against a decode step's, on the model itself: the
whole forward without a cache (all but attention over the cache) at B rows x L tokens, its MLP and
lm_head alone, and the fused paged decode kernel reading each row's pages once (decode) or once per
position (a verification window of L tokens as B * L one-query rows). Medians of --iters timed
calls, each evaluated and synchronized. The kernel is also timed as --chain launches in one
evaluation (`kernel_chained_ms`: the GPU's time a launch once the host is out of the way) with the
K/V bytes it reads each launch over that time (`kernel_gb_s`).

    python -m benchmarks gpu.spec_ops --model smollm2 --batch 256 --window 5 --context 1500
"""
from __future__ import annotations

import json
import statistics
import time

import mlx.core as mx

from benchmarks import harness as h

SMOKE = ["--model", "tiny", "--batch", "2", "--window", "2", "--context", "32", "--iters", "2", "--no-kernel"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window", type=int, default=5, help="tokens a row in the verification pass (k + 1)")
    ap.add_argument("--context", type=int, default=1500, help="keys a row for the kernel's part")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--chain", type=int, default=20, help="kernel launches in one evaluation")
    ap.add_argument("--no-kernel", action="store_true", help="leave out the fused kernel's part (off CUDA)")


def _time(fn, iters: int) -> float:
    mx.eval(fn())
    mx.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def run(a) -> dict:
    model, _, spec = h.load(a.model)
    inner = model.model
    hid = inner.embed_tokens.weight.shape[-1] if not hasattr(inner.embed_tokens, "scales") else \
        inner.embed_tokens.scales.shape[-1] * inner.embed_tokens.group_size
    dtype = inner.norm.weight.dtype
    out: dict = {"model": a.model, "batch": a.batch, "window": a.window}
    for name, L in (("decode", 1), ("verify", a.window)):
        B = a.batch
        tokens = mx.random.randint(0, spec.vocab_size, (B, L))
        x = mx.random.normal((B * L, hid)).astype(dtype)
        head = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear
        out[name] = {
            "forward_nocache_ms": _time(lambda: model(tokens), a.iters),
            "mlp_layer0_ms": _time(lambda: inner.layers[0].mlp(x), a.iters),
            "lm_head_ms": _time(lambda: head(x), a.iters),
        }
        print(json.dumps({name: out[name]}), flush=True)
    if not a.no_kernel:
        from kvbatch.engine.config import CudaLaunch
        from kvbatch.engine.kv.routes.cuda_kernels import paged_decode_attention

        P, Hkv, D, Hq = 64, spec.num_kv_heads, spec.head_dim, spec.num_heads
        n = -(-a.context // P)
        pool = mx.random.normal((a.batch * n, Hkv, P, D)).astype(dtype)
        vpool = mx.random.normal((a.batch * n, Hkv, P, D)).astype(dtype)
        table = mx.arange(a.batch * n, dtype=mx.int32).reshape(a.batch, n)
        for name, L in (("decode", 1), ("verify", a.window)):
            q = mx.random.normal((a.batch * L, Hq, 1, D)).astype(dtype)
            t = mx.repeat(table, L, axis=0)
            lens = mx.full((a.batch * L,), a.context, dtype=mx.int32)
            ms = _time(lambda: paged_decode_attention(q, pool, vpool, t, lens, D ** -0.5, CudaLaunch()), a.iters)
            chained = _time(lambda: [paged_decode_attention(q, pool, vpool, t, lens, D ** -0.5, CudaLaunch())
                                     for _ in range(a.chain)], a.iters) / a.chain
            read = a.batch * L * a.context * Hkv * D * 2 * pool.dtype.size  # K and V, once per kernel row
            out[name].update(kernel_one_layer_ms=ms, kernel_chained_ms=chained, kernel_gb_s=read / chained / 1e6)
            print(json.dumps({name: {k: out[name][k] for k in ("kernel_one_layer_ms", "kernel_chained_ms",
                                                                "kernel_gb_s")}}), flush=True)
    return out
