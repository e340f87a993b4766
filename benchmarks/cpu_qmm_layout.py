"""Scores on quantized keys, MLX CPU: per-token keys + quantized_matmul(transpose=True) vs per-channel
keys (K^T quantized along tokens) + quantized_matmul(transpose=False) (issue 5). Ad-hoc probe; the f32 column
uses a transposed (non-contiguous) view and is not a fair float baseline.

    .venv/bin/python benchmarks/cpu_qmm_layout.py
"""
import sys, time
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
import kvbatch.engine
import mlx.core as mx
def bench(f, n=20):
    for _ in range(3): mx.eval(f())
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter()-t)
    ts.sort(); return ts[len(ts)//2]*1e3
for B,T in [(1,2048),(4,2048),(1,6144)]:
    Hkv,rep,D=3,3,64
    q=mx.random.normal((B,Hkv,rep,D)); k=mx.random.normal((B,Hkv,T,D))
    for bits in (8,4):
        wt=mx.quantize(k,group_size=64,bits=bits)            # per-token (along D)
        kT=k.swapaxes(-1,-2)                                  # (B,Hkv,D,T)
        wc=mx.quantize(kT,group_size=64,bits=bits)           # per-channel (along T)
        mx.eval(wt,wc)
        a=bench(lambda: mx.quantized_matmul(q,*wt,transpose=True,group_size=64,bits=bits))
        b=bench(lambda: mx.quantized_matmul(q,*wc,transpose=False,group_size=64,bits=bits))
        c=bench(lambda: q@kT)
        ref=q@kT
        ea=mx.abs(mx.quantized_matmul(q,*wt,transpose=True,group_size=64,bits=bits)-ref).mean().item()
        eb=mx.abs(mx.quantized_matmul(q,*wc,transpose=False,group_size=64,bits=bits)-ref).mean().item()
        print(f"B{B} T{T} q{bits}: per-token t=True {a:.3f} ms (err {ea:.4f}) | per-channel t=False {b:.3f} ms (err {eb:.4f}) | f32 {c:.3f} ms")
