"""Where a mixed-length prefill's time goes on a GPU: each pass's shape and seconds, cold and warm.

256 random prompts of 20-996 tokens (most short), prefilled by the engine (max_tokens=1) twice in
one process with fresh engines, then other prompts of the same spread ("new_shapes"): when the second
run is much faster than the first and the third is as slow as the first, passes pay for shapes met
for the first time (kernel compilation, library plans), not for compute. Each
pass is listed as (rows, padded length L, keys T, seconds). `--modes` A/Bs engine options as
benchmarks/gpu.py's mode strings do ("none", "none@prefill_buckets=false", "q8").

    python benchmarks/gpu_prefill_shapes.py --geometry 1b --rows 256 --modes none,q8 --out prefill.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import _engine, build, mode_options  # noqa: E402  (BLAS first, then mlx)
import mlx.core as mx  # noqa: E402

from kvbatch.engine.types import Request, SamplingParams  # noqa: E402


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(vocab) for _ in range(20 + int(976 * rnd.random() ** 2))] for _ in range(n)]


def timed_passes(eng) -> list[dict]:
    """Wrap the engine's prefill so each pass records its shape and wall seconds (synchronous:
    the pass ends with an eval)."""
    passes: list[dict] = []
    inner = eng.runner.prefill

    def prefill(batch):
        t0 = time.perf_counter()
        inner(batch)
        mx.synchronize()
        passes.append({"rows": len(batch), "L": max(n for _, n in batch),
                       "tokens": sum(n for _, n in batch), "s": round(time.perf_counter() - t0, 4)})

    eng.runner.prefill = prefill
    return passes


def run(model, spec, ps, mode: str, budget: int, new: int) -> dict:
    eng = _engine(model, spec, len(ps), mode, budget)
    passes = timed_passes(eng)
    t0 = time.perf_counter()
    res = eng.generate([Request(str(i), p, SamplingParams(max_tokens=new)) for i, p in enumerate(ps)])
    wall = time.perf_counter() - t0
    s = eng.summary()
    return {"mode": mode, "wall_s": wall, "prefill_s": s["prefill_s"], "decode_s": s["decode_s"],
            "prefill_tps": s["prefill_tokens_per_s"], "decode_tps": s["decode_tokens_per_s"],
            "prompt_tokens": sum(map(len, ps)), "generated": sum(len(r.tokens) for r in res),
            "errors": [r.error_code for r in res if r.error_code], "passes": passes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="1b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--modes", default="none")
    ap.add_argument("--new", type=int, default=1, help="new tokens per row (1: prefill only)")
    ap.add_argument("--out")
    a = ap.parse_args()
    model, spec = build(a.geometry)
    ps = mixed_prompts(a.rows, spec.vocab_size)
    budget = int(mx.device_info().get("memory_size", 80 << 30) * 0.8)
    out = []
    for mode in a.modes.split(","):
        mode_options(mode)  # fail early on a bad mode string
        for attempt, prompts in (("cold", ps), ("warm", ps), ("new_shapes", mixed_prompts(a.rows, spec.vocab_size, 1))):
            r = run(model, spec, prompts, mode, budget, a.new)
            r["attempt"] = attempt
            out.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "passes"}), flush=True)
            print("  passes:", [(p["rows"], p["L"], p["s"]) for p in r["passes"]], flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
