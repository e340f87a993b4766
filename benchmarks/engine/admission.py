"""Long outputs under a fixed budget: `engine.admission=optimistic` against `reserve`, side by side.

Every row may generate up to --max-tokens, but answers end at lengths spread over a long tail
(log-normal, median --median, capped at --max-tokens): the end is set by a test hook (the row is
teacher-forced with tokens of that length, so it ends there), the same lengths on both sides.
The budget is the weights plus room for --fit rows at their worst case, so `reserve` runs --fit
rows at a time while `optimistic` runs as many as their current lengths allow and preempts when
growth cannot fit. Reported per round (order alternating): wall time of the whole generate call,
preemptions, peak concurrency, and whether every row came back once with its tokens.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/admission.py --out benchmarks/results/admission.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.configs

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from kvbatch.engine.engine import Engine
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.types import Request, SamplingParams
from tests.configs import engine_config

# 16 layers: KV bytes per token (16 KiB) as large as the activations the memory model prices per prefill token
TINY = dict(source="tiny", name="tiny-16l", family="llama", num_layers=16, hidden_size=256, num_heads=4,
            num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=4096, context_length=8192)


def run(m, admission: str, budget: int, reqs: list[Request], forced: dict, args) -> dict:
    model, tok, spec = m
    eng = Engine(model, tok, spec, engine_config(kv_mode=args.kv, page_size=16, max_batch=args.max_batch,
                                                memory_budget=budget, admission=admission))
    for k, f in forced.items():
        eng.hooks.force(k, f, capture=False)
    t0 = time.perf_counter()
    res = eng.generate(reqs)
    wall = time.perf_counter() - t0
    s = eng.summary()
    ok = all(r.ok and r.tokens == forced[r.key] for r in res) and len({r.key for r in res}) == len(reqs)
    return {"admission": admission, "wall_s": wall, "rows_ok_and_exact": ok, "preemptions": s["preemptions"],
            "peak_concurrency": s["peak_concurrency"], "tokens": sum(len(r.tokens) for r in res),
            "prefill_s": s["prefill_s"], "decode_s": s["decode_s"], "prefill_tokens": s["prefill_tokens_total"],
            "peak_kv_pool_bytes": s["peak_capacity_pages"] * eng.layout.page_bytes,
            "kv_room_bytes": budget - spec.weights_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--median", type=int, default=200)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--fit", type=int, default=4, help="rows whose worst case fits the budget")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--kv", default="none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    m = load_model(ModelConfig(cache_dir=tempfile.mkdtemp(prefix="kvbatch-adm-"), **TINY))
    rnd = random.Random(5)
    lengths = [min(a.max_tokens, max(1, int(rnd.lognormvariate(math.log(a.median), a.sigma)))) for _ in range(a.rows)]
    prompts = [[(7 * i + 3 * j) % 4000 + 1 for j in range(rnd.randint(16, 200))] for i in range(a.rows)]
    forced = {f"r{i}": [(11 * i + 5 * j) % 4000 + 1 for j in range(n)] for i, n in enumerate(lengths)}
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=a.max_tokens)) for i, p in enumerate(prompts)]
    probe = Engine(m[0], m[1], m[2], engine_config(kv_mode=a.kv, page_size=16, max_batch=a.max_batch,
                                                   memory_budget=2 << 30))
    budget = probe.memory.bytes_for([max(map(len, prompts)) + a.max_tokens] * a.fit, max(map(len, prompts)))
    del probe
    rounds = []
    for k in range(a.rounds):
        order = ["reserve", "optimistic"] if k % 2 == 0 else ["optimistic", "reserve"]
        r = {name: run(m, name, budget, reqs, forced, a) for name in order}
        line = {"round": k, "order": order, **{f"{n}": r[n] for n in order},
                "speedup": r["reserve"]["wall_s"] / r["optimistic"]["wall_s"]}
        print(json.dumps(line), flush=True)
        rounds.append(line)
        mx.clear_cache()
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "mlx": mx.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a), "budget_bytes": budget,
              "lengths": {"median": statistics.median(lengths), "max": max(lengths), "mean": statistics.mean(lengths)},
              "median_speedup": statistics.median(r["speedup"] for r in rounds), "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
