"""What a fork of `n` samples costs (issue 21): the KV cache's fork shares the full pages and copies the
partly filled one (kv none: one page in every layer's K/V buffer; q8/q4: the dense tail page). The copy must
be done in place (MLX donates the buffer to the scatter), not by copying the pool: so its time must stay flat
as the pool grows. 4 prompts of 300 tokens, n=8 each; every fork timed alone (the store evaluated before and
after: harness.time_forks), at two pool sizes.

    python -m benchmarks engine.fork_cost [--model smollm2]
"""
from __future__ import annotations

import json
import statistics

from benchmarks import harness as h
from kvbatch.engine.samples import samples
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--model", "tiny", "--prompts", "2", "--n", "2", "--prompt", "20", "--pool-pages", "0,64"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--modes", default="none,q8")
    ap.add_argument("--pool-pages", default="0,4096", help="pool sizes to grow to first (0: as the engine grows it)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--n", type=int, default=8)


def run(a) -> dict:
    model, tok, spec = h.load(a.model)
    rows = []
    for mode in a.modes.split(","):
        for pool_pages in map(int, a.pool_pages.split(",")):
            eng = h.engine(model, tok, spec, mode, page_size=16, memory_budget=8 << 30, max_batch=64)
            if pool_pages:
                h.grow_pool(eng, pool_pages, 8 << 30)
            reqs = [s for i in range(a.prompts) for s in samples(Request(
                f"q{i}", [(7 * j + i) % min(5000, spec.vocab_size) for j in range(a.prompt)],
                SamplingParams(max_tokens=8, temperature=0.8)), a.n)]
            with h.time_forks(eng) as times:
                eng.generate(reqs)
            pool = h.kv_pool(eng)
            row = {"mode": mode, "pool_pages": pool["capacity_pages"], "pool_bytes": pool["capacity_bytes"],
                   "forks": len(times), "median_ms": statistics.median(times) * 1e3 if times else None,
                   "max_ms": max(times) * 1e3 if times else None}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"rows": rows}
