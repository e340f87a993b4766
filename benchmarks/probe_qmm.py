"""Where MLX CUDA's quantized ops go wrong at the engine's decode shapes (issue 9).

Compares, on the current backend, mx.quantize against the CPU's, and mx.quantized_matmul
(as the portable route `paged_qmm_f32` calls it) against dequantize-then-matmul, printing
max |error| and non-finite counts; then runs a small model with 1B-like heads through the
Engine with q8 on the portable route and on the fused kernel, counting non-finite rows.

    python benchmarks/probe_qmm.py
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine  # noqa: E402,F401
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def stat(name: str, got: mx.array, ref: mx.array) -> None:
    g, r = np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32))
    bad = int((~np.isfinite(g)).sum())
    fin = np.isfinite(g)
    err = float(np.abs(g[fin] - r[fin]).max()) if fin.any() else float("nan")
    print(f"{name:60s} max|err|={err:.2e} nonfinite={bad}/{g.size} |ref|max={np.abs(r).max():.2e}", flush=True)


def attempt(name: str, fn, ref) -> None:
    try:
        out = fn()
        mx.eval(out)
        stat(name, out, ref)
    except Exception as e:
        print(f"{name:60s} ERROR {str(e)[:150]}", flush=True)


def ops(B=64, hkv=8, rep=4, D=64, T=192, P=64, group=64) -> None:
    mx.random.seed(0)
    k = mx.random.normal((B, hkv, T, D)).astype(mx.bfloat16)
    for bits in (8, 4):
        tag = f"q{bits} B={B} Hkv={hkv} rep={rep} D={D} T={T}"
        wg, sg, bg = mx.quantize(k, group_size=group, bits=bits)
        wc, sc, bc = mx.quantize(k, group_size=group, bits=bits, stream=mx.cpu)
        mism = float((np.array(wg) != np.array(wc)).mean())
        print(f"quantize GPU vs CPU {tag}: packed words differing {mism:.2%}", flush=True)
        stat(f"  scales GPU vs CPU {tag}", sg, sc)
        stat(f"  biases GPU vs CPU {tag}", bg, bc)
        kt = k.transpose(0, 2, 1, 3)  # not row-contiguous
        wt, st, bt = mx.quantize(kt, group_size=group, bits=bits)
        deq_t = mx.dequantize(wt, st, bt, group_size=group, bits=bits)
        stat(f"  quantize(transposed view) GPU vs CPU {tag}", deq_t,
             mx.dequantize(*mx.quantize(kt, group_size=group, bits=bits, stream=mx.cpu), group_size=group,
                           bits=bits, stream=mx.cpu))
        s32, b32 = sg.astype(mx.float32), bg.astype(mx.float32)
        deq = mx.dequantize(wg, s32, b32, group_size=group, bits=bits)  # float32 reference
        stat(f"  dequantize GPU vs CPU {tag}", deq, mx.dequantize(wg, s32, b32, group_size=group, bits=bits,
                                                                  stream=mx.cpu))
        for M in (rep, 2, 1):
            x = mx.random.normal((B, hkv, M, D))
            ref = x @ deq.swapaxes(-1, -2)
            attempt(f"  qmm T x f32 M={M} scales f32 {tag}",
                    lambda: mx.quantized_matmul(x, wg, s32, b32, transpose=True, group_size=group, bits=bits), ref)
            attempt(f"  (same, vs keys of batch entry 0 for every entry) {tag}",
                    lambda: mx.quantized_matmul(x, wg, s32, b32, transpose=True, group_size=group, bits=bits),
                    x @ mx.broadcast_to(deq[:1, :1], deq.shape).swapaxes(-1, -2))
            attempt(f"  qmm T x f32 M={M}, one (row, head) at a time {tag}",
                    lambda: mx.concatenate([mx.quantized_matmul(x[i:i + 1, j:j + 1], wg[i:i + 1, j:j + 1],
                                                                s32[i:i + 1, j:j + 1], b32[i:i + 1, j:j + 1],
                                                                transpose=True, group_size=group, bits=bits)
                                            for i in range(B) for j in range(hkv)]).reshape(B, hkv, M, T), ref)
            attempt(f"  qmm T x bf16 M={M} scales bf16 {tag}",
                    lambda: mx.quantized_matmul(x.astype(mx.bfloat16), wg, sg, bg, transpose=True, group_size=group,
                                                bits=bits), ref)
        # value side as the engine runs it: probs over [quantized | tail], the quantized part sliced off
        pr = mx.softmax(mx.random.normal((B, hkv, rep, T + P)), axis=-1)
        pq = pr[..., :-P].reshape(B * hkv, rep, T)
        w3, s3, b3 = (a.reshape(B * hkv, T, -1) for a in (wg, s32, b32))
        ref = pq @ deq.reshape(B * hkv, T, D)
        attempt(f"  qmm N p f32 strided slice {tag}",
                lambda: mx.quantized_matmul(pq, w3, s3, b3, transpose=False, group_size=group, bits=bits), ref)
        pc = mx.contiguous(pq)
        attempt(f"  qmm N p f32 contiguous {tag}",
                lambda: mx.quantized_matmul(pc, w3, s3, b3, transpose=False, group_size=group, bits=bits), ref)


def engine_rows(fused: bool, mode: str = "q8", B: int = 64) -> None:
    from mlx_lm.models import llama

    from kvbatch.engine.engine import Engine, EngineConfig
    from kvbatch.engine.models.spec import model_spec
    from kvbatch.engine.types import Request, SamplingParams

    class Tok:
        eos_token_ids: list[int] = []

        def decode(self, t):
            return ""

    os.environ["KVBATCH_FUSED_ATTENTION"] = "1" if fused else "0"
    cfg = dict(model_type="llama", hidden_size=512, num_hidden_layers=2, intermediate_size=1024,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=1024, rms_norm_eps=1e-5,
               max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=500000.0)
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs(**cfg))
    m.set_dtype(mx.bfloat16)
    mx.eval(m.parameters())
    spec = model_spec("llama-1b-heads", m, cfg)
    eng = Engine(m, Tok(), spec, EngineConfig(kv_mode=mode, page_size=64, max_batch=B, prefill_chunk=2048,
                                              memory_budget=8 << 30, allow_unvalidated=True))
    rng = np.random.default_rng(1)
    reqs = [Request(str(i), rng.integers(0, 1024, 128).tolist(), SamplingParams(max_tokens=40)) for i in range(B)]
    res = eng.generate(reqs)
    codes: dict = {}
    for r in res:
        codes[r.error_code or "ok"] = codes.get(r.error_code or "ok", 0) + 1
    first = next((r.error_message for r in res if r.error_code), "")
    print(f"engine {mode} fused={fused} batch {B}: route={eng.summary()['route']} {codes} {first[:160]}", flush=True)
    os.environ.pop("KVBATCH_FUSED_ATTENTION", None)


def main() -> None:
    print(mx.default_device(), mx.__version__, flush=True)
    if "--engine-only" not in sys.argv:
        ops(B=4, hkv=8, rep=4, D=64, T=192, P=64)
    for fused in (False, True):
        for mode in ("q8", "q4"):
            engine_rows(fused, mode, B=16)


if __name__ == "__main__":
    main()
