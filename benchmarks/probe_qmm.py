"""Which mx.quantized_matmul shapes/dtypes the current backend implements (attention-shaped)."""
import itertools

import mlx.core as mx

print(mx.default_device())
for dt, bits, D, shape, T in itertools.product((mx.bfloat16, mx.float32), (8,), (64, 128),
                                              ("4d", "5d"), (256,)):
    B, Hkv, rep = 2, 8, 4
    k = mx.random.normal((B, Hkv, T, D)).astype(dt)
    w, s, b = mx.quantize(k, group_size=64, bits=bits)
    if shape == "4d":
        q = mx.random.normal((B, Hkv, rep, D)).astype(dt)
        args = (w, s, b)
    else:
        q = mx.random.normal((B, Hkv, rep, 1, D)).astype(dt)
        args = tuple(a[:, :, None] for a in (w, s, b))
    res = []
    for tr in (True, False):
        try:
            if tr:
                out = mx.quantized_matmul(q, *args, transpose=True, group_size=64, bits=bits)
            else:
                p = mx.softmax(mx.random.normal(q.shape[:-1] + (T,)).astype(dt), axis=-1)
                wv, sv, bv = args
                out = mx.quantized_matmul(p, wv, sv, bv, transpose=False, group_size=64, bits=bits)
            mx.eval(out)
            res.append("ok")
        except Exception as e:
            res.append("NO")
    print(f"{str(dt):16s} bits={bits} D={D} {shape} T={T}: qk^T {res[0]}  pV {res[1]}", flush=True)
