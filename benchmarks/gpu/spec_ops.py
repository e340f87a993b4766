"""What the pieces of a verification pass cost against a decode step's, on the model itself: the
whole forward without a cache (all but attention over the cache) at B rows x L tokens, its MLP and
lm_head alone, and the fused paged decode kernel reading each row's pages once (decode) or once per
position (a verification window of L tokens as B * L one-query rows), against the window kernel
reading them once for all of a row's window on the tensor cores (`window_tc`, bf16/fp16), beside decode
on them (`decode_tc`), with whether each window position has the bits decode gives it
(`same_bits_as_decode_tc`). Medians of --iters timed
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
        from kvbatch.engine.kv.routes.cuda_kernels import paged_decode_attention, paged_window_attention

        P, Hkv, D, Hq = 64, spec.num_kv_heads, spec.head_dim, spec.num_heads
        n = -(-a.context // P)
        pool = mx.random.normal((a.batch * n, Hkv, P, D)).astype(dtype)
        vpool = mx.random.normal((a.batch * n, Hkv, P, D)).astype(dtype)
        table = mx.arange(a.batch * n, dtype=mx.int32).reshape(a.batch, n)
        L = a.window
        firsts = mx.full((a.batch,), a.context - L, dtype=mx.int32)
        lengths = mx.full((a.batch,), a.context, dtype=mx.int32)
        qw = mx.random.normal((a.batch, Hq, L, D)).astype(dtype)
        per_position = (firsts[:, None] + mx.arange(1, L + 1, dtype=mx.int32)).reshape(-1)  # query j: firsts + j + 1
        # (pages read a row, the call, its settings): decode, one query a row, and a window of L as B * L such rows,
        # in the decode-style kernel (tensor_cores=false) and on the tensor cores (`_tc`: a window reads each
        # row's pages once)
        plain, tc = CudaLaunch(tensor_cores=False), CudaLaunch()

        def decode(launch):
            return paged_decode_attention(qw[:, :, :1], pool, vpool, table, lengths, D ** -0.5, launch)

        def verify(launch):
            return paged_decode_attention(qw.transpose(0, 2, 1, 3).reshape(a.batch * L, Hq, 1, D), pool, vpool,
                                          mx.repeat(table, L, axis=0), per_position, D ** -0.5, launch)

        def window(launch):
            return paged_window_attention(qw, pool, vpool, table, firsts, lengths, D ** -0.5, launch)

        cases = {"decode": (1, decode, plain), "decode_tc": (1, decode, tc), "verify": (L, verify, plain),
                 "window_tc": (1, window, tc)}
        for name, (reads, fn, launch) in cases.items():
            ms = _time(lambda: fn(launch), a.iters)
            chained = _time(lambda: [fn(launch) for _ in range(a.chain)], a.iters) / a.chain
            read = a.batch * reads * a.context * Hkv * D * 2 * pool.dtype.size  # K and V bytes the kernel reads
            out.setdefault(name, {}).update(kernel_one_layer_ms=ms, kernel_chained_ms=chained,
                                            kernel_gb_s=read / chained / 1e6)
            print(json.dumps({name: {k: out[name][k] for k in ("kernel_one_layer_ms", "kernel_chained_ms",
                                                                "kernel_gb_s")}}), flush=True)
        # the window on the tensor cores against decode on them, position by position: the same bits
        got = window(tc)
        same = [mx.array_equal(got[:, :, j], paged_decode_attention(
            qw[:, :, j:j + 1], pool, vpool, table, firsts + j + 1, D ** -0.5, tc)[:, :, 0]).item() for j in range(L)]
        out["window_tc"]["same_bits_as_decode_tc"] = all(same)
        print(json.dumps({"window_tc_same_bits_as_decode_tc": same}), flush=True)
    return out
