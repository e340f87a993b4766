"""What a fork of `n` samples costs (issue 21): PagedKVCache.fork shares the full pages and copies
the partly filled one (kv none: one page in every layer's K/V buffer; q8/q4: the dense tail page).
The copy must be done in place (MLX donates the buffer to the scatter), not by copying the pool:
so its time must stay flat as the pool grows. SmolLM2, 4 prompts of 300 tokens, n=8 each; every
fork timed alone (the store evaluated before and after), at two pool sizes.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/fork_cost.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvbatch.engine as engine  # noqa: E402  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from kvbatch.engine.engine import Engine  # noqa: E402
from kvbatch.engine.kv.cache import PagedKVCache  # noqa: E402
from kvbatch.engine.models.config import ModelConfig  # noqa: E402
from kvbatch.engine.samples import samples  # noqa: E402
from kvbatch.engine.types import Request, SamplingParams  # noqa: E402
from tests.configs import engine_config  # noqa: E402


def main() -> None:
    model, tok, spec = engine.load_model(ModelConfig())
    orig = PagedKVCache.fork
    for mode in ("none", "q8"):
        for pool_pages in (0, 4096):
            eng = Engine(model, tok, spec, engine_config(kv_mode=mode, page_size=16, memory_budget=8 << 30,
                                                         max_batch=64))
            if pool_pages:
                eng.cache._grow(pool_pages, 8 << 30)
            times: list[float] = []

            def fork(self, *a, **k):
                mx.eval(self.store.all_arrays())
                t = time.perf_counter()
                orig(self, *a, **k)
                mx.eval(self.store.all_arrays())
                times.append(time.perf_counter() - t)

            PagedKVCache.fork = fork
            reqs = [s for i in range(4) for s in samples(Request(
                f"q{i}", [(7 * j + i) % 5000 for j in range(300)], SamplingParams(max_tokens=8, temperature=0.8)), 8)]
            eng.generate(reqs)
            PagedKVCache.fork = orig
            print(json.dumps({"mode": mode, "pool_pages": eng.cache.capacity_pages,
                              "pool_bytes": eng.cache.capacity_bytes, "forks": len(times),
                              "median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3}))


if __name__ == "__main__":
    main()
