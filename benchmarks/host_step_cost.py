"""Host time of building one decode step's graph on the CUDA route, measured without a GPU.

On the H200 a decode step at batch 1-8 is bound by the host: building the step's graph in
Python and MLX launching its kernels take the whole step while the GPU waits (RESULTS.md,
issue 9, sixth session: 3.1 + 4.7 ms of an 8.3 ms step at 8B batch 1). The Python part does
not depend on the device, so it can be measured here: the engine is built as on MLX CUDA
(fused decode kernels, the kernel storing the new K/V) with each kernel call replaced by a
stand-in of the same inputs and outputs, and one decode step's forward is built (not evaluated)
over and over. Reported per layer: the whole forward, and the paged cache's own share
(PagedKVCache.write + attend: the plan lookups, `cuda_attention._launch`, the kernel call).
Not measured: MLX's dispatch of the kernels (async_eval) and the stand-in's own cost.

    python benchmarks/host_step_cost.py --batches 1,8 --modes none,q8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvbatch.engine  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

from kvbatch.engine import cuda_attention  # noqa: E402


class _StandIn:
    """A kernel call with the real one's inputs and outputs (mx.depends keeps the inputs in the graph)."""

    def __call__(self, inputs, output_shapes, output_dtypes, **kw):
        outs = [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        return mx.depends(outs, list(inputs))


def _as_on_cuda() -> None:
    from kvbatch.engine import kv_cache

    cuda_attention.available = lambda: True
    cuda_attention._kernel = lambda *a, **k: _StandIn()
    kv_cache.k_quant_axis = lambda layout: "token"  # q8/q4 keys per token, as off the CPU


def measure(model, spec, batch: int, mode: str, prompt: int, reps: int) -> dict:
    from gpu import _engine, prompts
    from kvbatch.engine.types import Request, SamplingParams

    from kvbatch.engine import rope

    eng = _engine(model, spec, batch, mode, int(8e9))
    rope.uninstall(model)  # MLX's RoPE, as on a GPU (the per-step table is the CPU's)
    assert eng.cache.fused_decode, "the engine did not take the CUDA route"
    for i, p in enumerate(prompts(batch, prompt, spec.vocab_size)):
        eng.submit(Request(str(i), p, SamplingParams(max_tokens=8)))
    eng._admit()  # prefill (portable route, evaluated)
    cache, rows = eng.cache, [r.kv for r in eng.running]
    mx.eval(cache.store.all_arrays())
    for r in rows:
        cache.reserve(r, 1, 1 << 40)
    toks = mx.zeros((batch, 1), dtype=mx.int32)
    own = [0.0]
    write, attend = cache.write, cache.attend

    def timed(fn):
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                own[0] += time.perf_counter() - t
        return w

    cache.write, cache.attend = timed(write), timed(attend)
    begin, forward = [], []
    for _ in range(reps):
        own[0] = 0.0
        t0 = time.perf_counter()
        cache.begin(rows, 1)
        t1 = time.perf_counter()
        model(toks, cache=cache.views)
        t2 = time.perf_counter()
        cache.plan = None  # not evaluated: the step is only built
        begin.append(t1 - t0)
        forward.append((t2 - t1, own[0]))
    n = spec.num_layers
    fw = statistics.median(f for f, _ in forward)
    ow = statistics.median(o for _, o in forward)
    return {"batch": batch, "mode": mode, "route": cache.route, "begin_us": statistics.median(begin) * 1e6,
            "forward_us_per_layer": fw / n * 1e6, "cache_us_per_layer": ow / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="tiny", help="a gpu.py geometry (the per-layer Python is the same in all)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default="none,q8,q4")
    ap.add_argument("--prompt", type=int, default=1100, help="tokens per row (over 1,024: the split-K launch)")
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    _as_on_cuda()
    from gpu import build

    model, spec = build(a.geometry)
    for batch in map(int, a.batches.split(",")):
        for mode in a.modes.split(","):
            r = measure(model, spec, batch, mode, a.prompt, a.reps)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}), flush=True)


if __name__ == "__main__":
    main()
