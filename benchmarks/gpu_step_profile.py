"""Where a kvbatch decode step's time goes on a GPU backend, next to mlx-lm's step.

Random bf16 weights in a gpu.py geometry, greedy, 128-token prompts. For each batch:
- kvbatch: mean ms per decode step, split into host phases (reserve, cache.begin =
  page tables and slot maps, graph build = model forward + sampling as lazy MLX calls,
  eval = dispatch + wait for the GPU, accept = tokens to the host and row bookkeeping);
- the same engine with a one-step lookahead (the next step's graph is built and
  dispatched with mx.async_eval before this step's tokens are read: what mlx-lm's
  BatchGenerator does), driven here from the engine's own cache and sampler calls;
- mlx-lm's BatchGenerator: ms per step from its generation tok/s.

    python benchmarks/gpu_step_profile.py --geometry 1b --batches 8,64
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

import engine.engine as eng_mod  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import _NullTokenizer, build, prompts, run_mlx_lm  # noqa: E402
from engine.engine import Engine, EngineConfig  # noqa: E402
from engine.types import Request, SamplingParams  # noqa: E402


def _engine(model, spec, batch, mode):
    return Engine(model, _NullTokenizer(), spec,
                  EngineConfig(kv_mode=mode, page_size=64, max_batch=batch, prefill_chunk=2048,
                               memory_budget=int(100e9), allow_unvalidated=True))


def phases(model, spec, ps, new, mode) -> dict:
    """kvbatch's own decode loop, each host phase timed (wrappers add ~µs)."""
    e = _engine(model, spec, len(ps), mode)
    acc: dict = defaultdict(float)
    in_step = [False]

    def timed(name, fn):
        def w(*a, **kw):
            if not in_step[0]:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += time.perf_counter() - t
        return w

    e.cache.reserve = timed("reserve", e.cache.reserve)
    e.cache.begin = timed("begin", e.cache.begin)
    e._accept = timed("accept", e._accept)
    real_fwd, real_sample, real_eval = eng_mod._forward_last, eng_mod.sample_batch, mx.eval
    eng_mod._forward_last = timed("graph_forward", real_fwd)
    eng_mod.sample_batch = timed("graph_sample", real_sample)
    mx.eval = timed("eval", real_eval)
    step = e._decode_step
    n = [0]

    def counted():
        in_step[0] = True
        t = time.perf_counter()
        step()
        acc["step"] += time.perf_counter() - t
        in_step[0] = False
        n[0] += 1

    e._decode_step = counted
    try:
        e.generate([Request(str(i), p, SamplingParams(max_tokens=new)) for i, p in enumerate(ps)])
    finally:
        eng_mod._forward_last, eng_mod.sample_batch, mx.eval = real_fwd, real_sample, real_eval
    out = {k: v / n[0] * 1e3 for k, v in acc.items()}
    out["steps"] = n[0]
    out["tok_s"] = len(ps) / (acc["step"] / n[0])
    return out


def lookahead(model, spec, ps, new, mode) -> dict:
    """The same rows, cache and sampling, with one step in flight while the host prepares
    the next (every row runs `new` steps; no EOS here)."""
    e = _engine(model, spec, len(ps), mode)
    for i, p in enumerate(ps):
        e.submit(Request(str(i), p, SamplingParams(max_tokens=new)))
    e._admit()  # prefills every row
    rows = list(e.running)
    kv = [r.kv for r in rows]
    samplers = [r.sampler for r in rows]
    tokens = mx.array([r.out[-1] for r in rows])
    pending = None
    t0 = time.perf_counter()
    for _ in range(new - 1):
        limit, want = e._kv_limit(), e._pool_want()
        for r in kv:
            e.cache.reserve(r, 1, limit, want)
        e.cache.begin(kv, 1)
        logits = eng_mod._forward_last(model, tokens[:, None], e.cache.views).astype(mx.float32)
        nxt = eng_mod.sample_batch(logits, samplers)
        finite = mx.isfinite(logits).all(axis=-1)
        mx.async_eval(nxt, finite)
        e.cache.end()
        if pending is not None:
            pending[0].tolist(), pending[1].tolist()
        pending, tokens = (nxt, finite), nxt
    pending[0].tolist()
    dt = (time.perf_counter() - t0) / (new - 1)
    e.cancel()
    return {"step": dt * 1e3, "tok_s": len(ps) / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="1b")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--modes", default="none")
    a = ap.parse_args()
    model, spec = build(a.geometry)
    for batch in map(int, a.batches.split(",")):
        ps = prompts(batch, 128, spec.vocab_size)
        for mode in a.modes.split(","):  # warm-up: past the first sealed page (64), every kernel variant
            phases(model, spec, ps, 80, mode)
        run_mlx_lm(model, ps, 16)
        row = {"geometry": a.geometry, "batch": batch}
        m = run_mlx_lm(model, ps, a.new)
        row["mlx_lm_step_ms"] = batch / m["decode_tps"] * 1e3
        for mode in a.modes.split(","):
            row[f"kvbatch_{mode}"] = phases(model, spec, ps, a.new, mode)
            row[f"lookahead_{mode}"] = lookahead(model, spec, ps, a.new, mode)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else
                              {kk: round(vv, 3) for kk, vv in v.items()} if isinstance(v, dict) else v)
                          for k, v in row.items()}), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
