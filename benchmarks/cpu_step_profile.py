"""Where a CPU decode step goes on the tiny model (issue 3), and whether lookahead helps here.

1. The step split: `Engine._decode_step` timed whole and with `mx.eval` wrapped, so a step is
   "waiting in mx.eval" (the compute) + host work (building the graph, kvbatch's bookkeeping).
2. Decode lookahead (engine/lookahead.py) against the plain loop, alternated in one process,
   `--rounds` runs each; the greedy tokens must match.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/cpu_step_profile.py --batch 8 --page-size 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import kvbatch.engine  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from kvbatch.engine import engine as engine_mod  # noqa: E402
from kvbatch.engine.engine import Engine, EngineConfig  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.models.load import load_model  # noqa: E402
from kvbatch.engine.types import Request, SamplingParams  # noqa: E402
from engine_vs_mlx_lm import TINY, _NoEos  # noqa: E402


def run(model, tok, spec, prompts, page, new, lookahead: bool, split: bool = False) -> dict:
    os.environ["KVBATCH_LOOKAHEAD"] = "1" if lookahead else "0"
    eng = Engine(model, tok, spec, EngineConfig(max_batch=len(prompts), page_size=page, prefill_chunk=512))
    for i, p in enumerate(prompts):
        eng.submit(Request(f"r{i}", p, SamplingParams(max_tokens=new)))
    steps, evals = [], []
    if split:
        real_eval, plain = mx.eval, eng._decode_step

        def timed_eval(*a):
            t = time.perf_counter()
            real_eval(*a)
            evals.append(time.perf_counter() - t)

        def step():
            t = time.perf_counter()
            engine_mod.mx.eval = timed_eval
            try:
                plain()
            finally:
                engine_mod.mx.eval = real_eval
            steps.append(time.perf_counter() - t)

        eng._decode_step = step
    t0 = time.perf_counter()
    out = list(eng.run())
    wall = time.perf_counter() - t0
    r = {"tok_s": sum(x.stats.output_tokens for x in out) / (wall - eng.prefill_time),
         "tokens": {x.key: x.tokens for x in out}}
    if split:
        r["step_ms"] = statistics.median(steps) * 1e3
        r["eval_ms"] = statistics.median(evals[-len(steps):]) * 1e3
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    mx.set_cache_limit(2 << 30)  # as engine_vs_mlx_lm.py runs both sides
    model, tok, spec = load_model(ModelConfig(**TINY, cache_dir=tempfile.mkdtemp()))
    tok = _NoEos(tok)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, spec.vocab_size, 128).tolist() for _ in range(args.batch)]
    for _ in range(2):
        r = run(model, tok, spec, prompts, args.page_size, args.new, False, split=True)
        print(f"batch {args.batch} page {args.page_size}: {r['tok_s']:.0f} tok/s, step {r['step_ms']:.2f} ms = "
              f"eval {r['eval_ms']:.2f} + host {r['step_ms'] - r['eval_ms']:.2f}", flush=True)
    rates = {False: [], True: []}
    tokens = {}
    for _ in range(args.rounds):
        for la in (False, True):
            r = run(model, tok, spec, prompts, args.page_size, args.new, la)
            rates[la].append(r["tok_s"])
            tokens[la] = r["tokens"]
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    print(f"lookahead off {[round(x) for x in rates[False]]} tok/s, on {[round(x) for x in rates[True]]}: "
          f"median ratio {ratio:.3f}; same tokens: {tokens[False] == tokens[True]}")


if __name__ == "__main__":
    main()
