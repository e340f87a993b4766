"""What a process pays the first time it meets a decode batch size, against the second time.

A cold `kvbatch` process on a GPU spends seconds that a warm run of the same job in the same process does
not (benchmarks/notebook/README.md, session AO), and a warm run with other prompt lengths does not either:
so the cost is per process, per something the same job's second run reuses. A decode step's batch size
takes every value from 1 to the batch as rows join and end, and each new size is a new shape for every
matmul (cuBLASLt looks up an algorithm, and may load its kernel, the first time it meets a shape) and every
other op. This times, in one fresh process and batch by batch, each size's first decode forward and its
second, synchronized:
- `matmul`: the up-projection (B, hidden) x (hidden, intermediate) alone, a shape the model never uses
  (so the model's own first times stay cold);
- `forward`: the model's forward of one token a row (no KV cache: the weights' matmuls, norms, RoPE and a
  one-key attention) and a greedy pick, as decode runs it;
- `padded`: the forward at batch sizes rounded up to a multiple of `--pad` (run after `forward`: the sizes it
  meets that `forward` did not are its cold ones), what bucketing the decode batch would cost instead.

    python -m benchmarks gpu.cold_shapes --geometry 1b --batches 1-256
"""
from __future__ import annotations

import statistics
import time

import mlx.core as mx

from benchmarks import harness as h

SMOKE = ["--geometry", "tiny", "--batches", "1-3,8", "--pad", "4"]


def add_args(ap) -> None:
    ap.add_argument("--geometry", default="1b", help="a harness.GEOMETRIES random model")
    ap.add_argument("--batches", default="1-256", help="batch sizes in the order met: '1-256', '1-16,32,64'")
    ap.add_argument("--pad", type=int, default=16, help="the `padded` pass's multiple")


def batch_sizes(text: str) -> list[int]:
    """'1-4,8' -> [1, 2, 3, 4, 8]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def _timed(fn, sizes: list[int]) -> dict:
    """Each size's synchronized seconds through fn(B): their sum, median and the five slowest."""
    ts = []
    for b in sizes:
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn(b))
        mx.synchronize()
        ts.append((time.perf_counter() - t, b))
    secs = [t for t, _ in ts]
    return {"sizes": len(sizes), "total_s": round(sum(secs), 4), "median_ms": round(statistics.median(secs) * 1e3, 3),
            "slowest": [[b, round(t * 1e3, 2)] for t, b in sorted(ts, reverse=True)[:5]]}


def run(a) -> dict:
    model, _ = h.build_random(a.geometry)
    sizes = batch_sizes(a.batches)
    hidden, inter = (h.GEOMETRIES[a.geometry][k] for k in ("hidden_size", "intermediate_size"))
    w = mx.random.normal((inter, hidden)).astype(mx.bfloat16)
    mx.eval(w)

    def matmul(b: int) -> mx.array:
        return mx.ones((b, hidden), dtype=mx.bfloat16) @ w.T

    def forward(b: int) -> mx.array:
        return mx.argmax(model(mx.zeros((b, 1), dtype=mx.int32))[:, -1, :], axis=-1)

    padded = sorted({-(-b // a.pad) * a.pad for b in sizes})
    out = {"device": str(mx.default_device()), "batches": a.batches}
    for name, fn, ss in (("matmul", matmul, sizes), ("forward", forward, sizes), ("padded", forward, padded)):
        out[f"{name}_cold"] = _timed(fn, ss)
        out[f"{name}_warm"] = _timed(fn, ss)
        out[f"{name}_cold_extra_s"] = round(out[f"{name}_cold"]["total_s"] - out[f"{name}_warm"]["total_s"], 4)
    return out
