"""Where a kvbatch decode step's time goes on a GPU backend, next to mlx-lm's step.

Random bf16 weights in a gpu.py geometry, greedy, 128-token prompts. For each batch:
- kvbatch: mean ms per decode step, split into host phases (reserve, cache.begin =
  page tables and slot maps, graph build = model forward + sampling as lazy MLX calls,
  eval = dispatch + wait for the GPU, accept = tokens to the host and row bookkeeping);
- the same with the engine's one-step lookahead (runner.LookaheadStepper: the next
  step is built and dispatched with mx.async_eval before this step's tokens are read, as
  mlx-lm's BatchGenerator does);
- mlx-lm's BatchGenerator: ms per step from its generation tok/s.

    python benchmarks/gpu_step_profile.py --geometry 1b --batches 8,64
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine  # noqa: E402,F401
import mlx.core as mx  # noqa: E402

import kvbatch.engine.runner as runner_mod  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import _NullTokenizer, build, mode_options, prompts, run_mlx_lm, warm_tokens  # noqa: E402
from kvbatch.engine.engine import Engine  # noqa: E402
from tests.configs import engine_config  # noqa: E402
from kvbatch.engine.types import Request, SamplingParams  # noqa: E402


def _engine(model, spec, batch, mode, lookahead: bool):
    kv_mode, opts = mode_options(mode)
    opts.lookahead = "on" if lookahead else "off"
    return Engine(model, _NullTokenizer(), spec,
                  engine_config(kv_mode=kv_mode, page_size=64, max_batch=batch, prefill_chunk=2048,
                                memory_budget=int(100e9), allow_unvalidated=True, options=opts))


def phases(model, spec, ps, new, mode, lookahead: bool, cprofile: int = 0) -> dict:
    """kvbatch's own decode loop (step by step, or with its one-step lookahead), each host
    phase timed by wrapping the engine's components (a profiler's instrumentation; the wrappers
    add ~us). With lookahead, `accept_step` is the wait for the in-flight step plus `accept`."""
    e = _engine(model, spec, len(ps), mode, lookahead)
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
    e.output.accept = timed("accept", e.output.accept)
    if lookahead:
        e.stepper._accept = timed("accept_step", e.stepper._accept)
    real = (runner_mod.forward_last, runner_mod.sample_batch, mx.eval, mx.async_eval)
    runner_mod.forward_last = timed("graph_forward", real[0])
    runner_mod.sample_batch = timed("graph_sample", real[1])
    mx.eval = timed("eval", real[2])
    mx.async_eval = timed("async_eval", real[3])
    step = e.stepper.step
    n = [0]
    prof = cProfile.Profile() if cprofile else None

    def counted():
        in_step[0] = True
        t = time.perf_counter()
        if prof:
            prof.enable()
        step()
        if prof:
            prof.disable()
        acc["step"] += time.perf_counter() - t
        in_step[0] = False
        n[0] += 1

    e.stepper.step = counted
    try:
        e.generate([Request(str(i), p, SamplingParams(max_tokens=new)) for i, p in enumerate(ps)])
    finally:
        runner_mod.forward_last, runner_mod.sample_batch, mx.eval, mx.async_eval = real
    out = {k: v / n[0] * 1e3 for k, v in acc.items()}
    out["calls"] = n[0]
    out["engine_decode_tok_s"] = e.summary()["decode_tokens_per_s"]
    if prof:  # the functions taking most of a step's host time, in us per step
        st = pstats.Stats(prof).stats
        top = sorted(st.items(), key=lambda kv: -kv[1][2])[:cprofile]
        out["cprofile_us_per_step"] = {f"{Path(f).name}:{ln}:{fn}":
                                       [round(v[2] / n[0] * 1e6, 1), round(v[3] / n[0] * 1e6, 1)]
                                       for (f, ln, fn), v in top}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="1b")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per row (8192: the long-context case)")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--modes", default="none", help="gpu.py modes, also MODE@OPTION=VALUE (e.g. q8@cuda.chunk=256)")
    ap.add_argument("--no-sync", action="store_true", help="lookahead loop only")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="also cProfile the lookahead steps: the N functions of most own time, "
                         "[own, cumulative] us a step")
    a = ap.parse_args()
    model, spec = build(a.geometry)
    for batch in map(int, a.batches.split(",")):
        ps = prompts(batch, a.prompt, spec.vocab_size)
        for mode in a.modes.split(","):  # warm-up: past the first sealed page (64) and, for every
            phases(model, spec, ps, max(80, warm_tokens(a.prompt, a.new)), mode, True)  # mode, its kernels (JIT)
        row = {"geometry": a.geometry, "batch": batch, "prompt": a.prompt}
        if not a.skip_mlx_lm:
            run_mlx_lm(model, ps, 16)
            m = run_mlx_lm(model, ps, a.new)
            row["mlx_lm_step_ms"] = batch / m["decode_tps"] * 1e3
        for mode in a.modes.split(","):
            if not a.no_sync:
                row[f"kvbatch_{mode}_sync"] = phases(model, spec, ps, a.new, mode, False)
            row[f"kvbatch_{mode}_lookahead"] = phases(model, spec, ps, a.new, mode, True, a.cprofile)
        def rounded(v):
            return round(v, 3) if isinstance(v, float) else v
        print(json.dumps({k: {kk: rounded(vv) for kk, vv in v.items()} if isinstance(v, dict) else rounded(v)
                          for k, v in row.items()}), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
