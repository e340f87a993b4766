"""One layer's q8/q4 CPU decode attention: packed pages gathered (the previous route) vs read in place
(`attention.quantized_paged_decode`, mx.gather_qmm), SmolLM2 shapes, kvbatch's own store (issue 5).

Each case builds a QuantizedStore (keys per channel, page 64, group 64) holding B rows of T sealed
tokens on scattered pages plus a half-full tail page, and times the two routes alternately (A, B, A,
B, ...) so both see the same machine conditions; medians in ms. "split" is the number of CPU streams
the engine's `stream_split` gives the case (both routes use it); the 1-stream rows force one.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/cpu_quant_decode_attention.py --out …
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kvbatch.engine.kv.routes import quant as att  # noqa: E402
from kvbatch.engine.kv.routes.cpu_streams import cpu_streams, stream_split  # noqa: E402
from kvbatch.engine.kv.store import QuantizedStore  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x2048,4x2048,1x6144,4x6144", help="BxT,...")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--one-stream", action="store_true", help="also each case on one stream")
    ap.add_argument("--split-ab", type=int, default=0, help="instead: in place on 1 stream vs on this many")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for c in a.cases.split(","):
        B, T = map(int, c.split("x"))
        for bits in map(int, a.bits.split(",")):
            for most in ([None, 1] if a.one_stream else [None]):
                r = case(B, T, bits, reps=a.reps, streams_max=most, split_ab=a.split_ab)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
                rows.append(r)
    if a.out:
        Path(a.out).write_text(json.dumps({"mlx": mx.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
