"""Host costs of the pieces a decode step is built from, on MLX's CUDA backend.

At 1B batch 8 with 8k context a kvbatch decode step is bound by the host (benchmarks/notebook/README.md,
eighth session: `cache.begin` 0.22 ms none / 0.58 ms q8, graph build 1.1 / 1.4 ms, async_eval
3.5 / 4.0 ms of a 5.1 / 6.3 ms step). This measures, in one process, what each piece costs:
- `array`: mx.array from Python lists of a step plan's sizes (lengths, lens, a page table),
  with the GPU idle and with it busy (a step's host work overlaps the previous step's kernels);
- `kernel`: async_eval of a chain of custom-kernel calls taking 4, 9 or 16 inputs (the dense
  kernel takes 9, the q8/q4 one 16), per call;
- `upload`: int32 arrays of 1k, 16k and 262k entries (a page table at 1,024 rows is ~70k), with the GPU
  busy, host time: `mx.array` (a new managed buffer each call) against a write into an array that already
  exists (through numpy's view of it) and the op that copies it on the device; and whether that copy holds
  the values.

    python -m benchmarks gpu.host_cost
"""
from __future__ import annotations

import json
import statistics
import time

import mlx.core as mx
import numpy as np

NEEDS = "cuda"
SMOKE = ["--reps", "20"]


def add_args(ap) -> None:
    ap.add_argument("--reps", type=int, default=400, help="mx.array calls per measure (kernels: half)")


def _busy() -> mx.array:
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(a)
    return a


def array_cost(reps: int = 400) -> dict:
    big = _busy()
    shapes = {"lengths_b8": [5000 + i for i in range(8)],
              "lens_b8x2": [[4992 + i, i] for i in range(8)],
              "table_b8x129": [[j for j in range(129)] for _ in range(8)],
              "flat_b8x132": [j for j in range(8 * 132)]}
    out = {}
    for busy in (False, True):
        for name, data in shapes.items():
            ts = []
            for i in range(reps):
                if busy and i % 8 == 0:
                    mx.synchronize()
                    mx.async_eval(big @ big @ big)  # ~ms of GPU work in flight
                t = time.perf_counter()
                a = mx.array(data, dtype=mx.int32)
                ts.append(time.perf_counter() - t)
                del a
            out[f"{name}{'_busy' if busy else ''}_us"] = round(statistics.median(ts) * 1e6, 2)
        mx.synchronize()
    return out


def kernel_cost(n_inputs: int, calls: int = 16, reps: int = 200) -> float:
    names = [f"x{i}" for i in range(n_inputs)]
    src = "int i = blockIdx.x * blockDim.x + threadIdx.x; out[i] = x0[i] + (T)1.0f;"
    k = mx.fast.cuda_kernel(name=f"host_cost_{n_inputs}", input_names=names, output_names=["out"], source=src)
    ins = [mx.zeros((4096,), dtype=mx.bfloat16) for _ in range(n_inputs)]
    mx.eval(ins)
    ts = []
    for r in range(reps + 10):
        x = ins[0]
        for _ in range(calls):
            (x,) = k(inputs=[x] + ins[1:], template=[("T", mx.bfloat16)], grid=(4096, 1, 1),
                     threadgroup=(256, 1, 1), output_shapes=[(4096,)], output_dtypes=[mx.bfloat16])
        t = time.perf_counter()
        mx.async_eval(x)
        dt = time.perf_counter() - t
        mx.synchronize()
        if r >= 10:
            ts.append(dt)
    return round(statistics.median(ts) / calls * 1e6, 2)


def upload_cost(reps: int, sizes: tuple[int, ...] = (1024, 16384, 262144)) -> dict:
    big = _busy()
    out: dict = {}
    for n in sizes:
        data = np.arange(n, dtype=np.int32)
        kept = mx.array(data)
        mx.eval(kept)
        view = np.array(kept, copy=False)  # the array's own memory: written in place, no allocation
        for how in ("mx_array", "in_place"):
            ts, ok = [], True
            for i in range(max(reps // 8, 4)):
                mx.synchronize()
                mx.async_eval(big @ big @ big)  # ~ms of GPU work in flight, as while the host builds a pass
                t = time.perf_counter()
                if how == "in_place":
                    view[:] = data + i
                    a = kept + 0  # the device's own copy, what a pass would read
                else:
                    a = mx.array(data + i)
                ts.append(time.perf_counter() - t)
                mx.eval(a)
                ok = ok and a[-1].item() == n - 1 + i
            out[f"upload_{how}_{n}_us"] = round(statistics.median(ts) * 1e6, 2)
            out[f"upload_{how}_{n}_values_ok"] = ok
    mx.synchronize()
    return out


def run(a) -> dict:
    row = array_cost(a.reps)
    row.update(upload_cost(a.reps))
    print(json.dumps(row), flush=True)
    for n in (4, 9, 16, 4, 9, 16):
        row.setdefault(f"kernel_{n}_inputs_us_per_call", []).append(kernel_cost(n, reps=max(a.reps // 2, 2)))
    print(json.dumps(row), flush=True)
    return row
