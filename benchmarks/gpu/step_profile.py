"""Where a kvbatch decode step's time goes on a GPU backend, next to mlx-lm's step.

Random bf16 weights in a harness GEOMETRIES geometry, greedy, 128-token prompts. For each batch:
- kvbatch: mean ms per decode step, split into host phases (reserve, cache.begin =
  page tables and slot maps, graph build = model forward + sampling as lazy MLX calls,
  eval = dispatch + wait for the GPU, accept = tokens to the host and row bookkeeping);
- the same with the engine's one-step lookahead (runner.LookaheadStepper: the next
  step is built and dispatched with mx.async_eval before this step's tokens are read, as
  mlx-lm's BatchGenerator does);
- mlx-lm's BatchGenerator: ms per step from its generation tok/s.
Every side runs --rounds times (default 2), the order reversed every other round: each figure is the median,
each round's value kept beside it (`<figure>_runs`).

    python -m benchmarks gpu.step_profile --geometry 1b --batches 8,64
"""
from __future__ import annotations

import cProfile
import json
import pstats
from pathlib import Path

import mlx.core as mx

from benchmarks import harness as h
from benchmarks.engine.vs_mlx_lm import warm_tokens

SMOKE = ["--geometry", "tiny", "--batches", "2", "--prompt", "8", "--new", "4", "--warm", "4", "--cprofile", "3",
         "--rounds", "2"]


def add_args(ap) -> None:
    ap.add_argument("--geometry", default="1b", help=", ".join(h.GEOMETRIES))
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per row (8192: the long-context case)")
    ap.add_argument("--warm", type=int, default=0, help="warm-up tokens (0: past the first sealed page, >= 80)")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds, order reversed every other; medians")
    ap.add_argument("--modes", default="none", help="modes, also MODE@OPTION=VALUE (e.g. q8@cuda.chunk=256)")
    ap.add_argument("--no-sync", action="store_true", help="lookahead loop only")
    ap.add_argument("--cprofile", type=int, default=0,
                    help="also cProfile the lookahead steps: the N functions of most own time, "
                         "[own, cumulative] us a step")


def _engine(model, spec, batch, mode, lookahead: bool):
    kv, opts = h.parse_mode(mode)
    opts.lookahead = "on" if lookahead else "off"
    return h.engine(model, h.NoEos(), spec, mode, options=opts, page_size=64, max_batch=batch, prefill_chunk=2048,
                    memory_budget=int(100e9), allow_unvalidated=True)


def phases(model, spec, ps, new, mode, lookahead: bool, cprofile: int = 0) -> dict:
    """kvbatch's own decode loop (step by step, or with its one-step lookahead), each host phase timed
    (harness.time_step_phases). With lookahead, `accept_step` is the wait for the in-flight step plus
    `accept`."""
    e = _engine(model, spec, len(ps), mode, lookahead)
    prof = cProfile.Profile() if cprofile else None
    with h.time_step_phases(e, prof) as acc:
        e.generate(h.requests(ps, new))
    n = max(acc.pop("calls"), 1)
    out = {k: v / n * 1e3 for k, v in acc.items()}
    out["calls"] = n
    out["engine_decode_tok_s"] = e.summary()["decode_tokens_per_s"]
    if prof:  # the functions taking most of a step's host time, in us per step
        st = pstats.Stats(prof).stats
        top = sorted(st.items(), key=lambda kv: -kv[1][2])[:cprofile]
        out["cprofile_us_per_step"] = {f"{Path(f).name}:{ln}:{fn}":
                                       [round(v[2] / n * 1e6, 1), round(v[3] / n * 1e6, 1)]
                                       for (f, ln, fn), v in top}
    return out


def _rounded(v):
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return round(v, 3) if isinstance(v, float) else v


def run(a) -> dict:
    model, spec = h.build_random(a.geometry)
    rows = []
    for batch in map(int, a.batches.split(",")):
        ps = h.random_prompts(batch, a.prompt, spec.vocab_size)
        for mode in a.modes.split(","):  # warm-up: past the first sealed page (64) and every mode's kernels (JIT)
            phases(model, spec, ps, a.warm or max(80, warm_tokens(a.prompt, a.new)), mode, True)
        row: dict = {"geometry": a.geometry, "batch": batch, "prompt": a.prompt}
        sides: dict = {}
        if not a.skip_mlx_lm:
            h.run_mlx_lm(model, ps, 16)

            def mlx_lm(batch=batch, ps=ps):
                m = h.run_mlx_lm(model, ps, a.new)
                return {"step_ms": batch / m["decode_tps"] * 1e3, "decode_tps": m["decode_tps"]}

            sides["mlx_lm"] = mlx_lm
        for mode in a.modes.split(","):
            if not a.no_sync:
                sides[f"kvbatch_{mode}_sync"] = lambda mode=mode, ps=ps: phases(model, spec, ps, a.new, mode, False)
            sides[f"kvbatch_{mode}_lookahead"] = lambda mode=mode, ps=ps: phases(model, spec, ps, a.new, mode, True,
                                                                                   a.cprofile)
        # every figure the median of the rounds (order reversed every other round), each round's value kept
        for side, runs in h.alternate(sides, a.rounds, log=False).items():
            cell = h.median_run(runs, key="decode_tps" if side == "mlx_lm" else "engine_decode_tok_s")
            if side == "mlx_lm":
                row["mlx_lm_step_ms"], row["mlx_lm_step_ms_runs"] = cell.get("step_ms"), cell.get("step_ms_runs")
            else:
                row[side] = cell
        print(json.dumps(_rounded(row)), flush=True)
        rows.append(_rounded(row))
        mx.clear_cache()
    return {"rows": rows}
