"""What the pieces of a verification pass cost against a decode step's, on the model itself: the
whole forward without a cache (all but attention over the cache) at B rows x L tokens, its MLP and
lm_head alone, and the fused paged decode kernel reading each row's pages once (decode) or once per
kernel row of a verification window (--groups: window positions a kernel row; 1 is one kernel row per
position). Medians of --iters timed
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
    ap.add_argument("--groups", default="1,2,5", help="window positions a kernel row (window_group's choices)")
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
        from kvbatch.engine.kv.routes.cuda_kernels import paged_decode_attention, paged_window_attention

        P, Hkv, D, Hq = 64, spec.num_kv_heads, spec.head_dim, spec.num_heads
        n = -(-a.context // P)
        pool = mx.random.normal((a.batch * n, Hkv, P, D)).astype(dtype)
        vpool = mx.random.normal((a.batch * n, Hkv, P, D)).astype(dtype)
        table = mx.arange(a.batch * n, dtype=mx.int32).reshape(a.batch, n)
        scale = D ** -0.5
        q1 = mx.random.normal((a.batch, Hq, 1, D)).astype(dtype)
        lens1 = mx.full((a.batch,), a.context, dtype=mx.int32)
        cases = {"decode": (1, lambda: paged_decode_attention(q1, pool, vpool, table, lens1, scale, CudaLaunch()))}
        for group in sorted({int(x) for x in a.groups.split(",")}):
            Lp = -(-a.window // group) * group  # the window padded to whole kernel rows
            qw = mx.random.normal((a.batch, Hq, Lp, D)).astype(dtype)
            tw = mx.repeat(table, Lp // group, axis=0)
            lw = mx.array([a.context - a.window + min(j, a.window - 1) + 1 for _ in range(a.batch) for j in range(Lp)],
                          dtype=mx.int32)
            cases[f"verify_g{group}"] = (Lp // group, lambda qw=qw, tw=tw, lw=lw, group=group: paged_window_attention(
                qw, pool, vpool, tw, lw, scale, CudaLaunch(), group))
        for name, (reads, fn) in cases.items():
            ms = _time(fn, a.iters)
            chained = _time(lambda fn=fn: [fn() for _ in range(a.chain)], a.iters) / a.chain
            read = a.batch * reads * a.context * Hkv * D * 2 * pool.dtype.size  # K and V, once per kernel row
            out.setdefault(name, {}).update(kernel_one_layer_ms=ms, kernel_chained_ms=chained,
                                            kernel_gb_s=read / chained / 1e6)
            print(json.dumps({name: out[name]}), flush=True)
    return out
