"""Where more rows stop adding tokens/s: decode tok/s of one engine at several batch sizes.

The ceiling of `engine.max_batch: auto` (engine/batch_limits.py) is the batch past which decode
tok/s stops growing on a backend. Each batch size decodes `--new` tokens for that many rows of
`--prompt` tokens (EOS off); the sizes run in alternating order over `--rounds` rounds, and the
median decode tok/s of each is reported with its ratio to the next smaller size.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/batch_ceiling.py --model smollm2 --batches 16,32,64,128
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
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


class _NoEos:
    eos_token_ids: list[int] = []

    def decode(self, tokens):
        return ""


def decode_tps(m, batch: int, prompt: int, new: int, kv: str) -> float:
    model, _, spec = m
    eng = Engine(model, _NoEos(), spec, engine_config(kv_mode=kv, max_batch=batch))
    reqs = [Request(f"r{i}", [(17 * i + 3 * j) % 1000 + 10 for j in range(prompt)], SamplingParams(max_tokens=new))
            for i in range(batch)]
    eng.generate(reqs)
    return eng.summary()["decode_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="16,32,64,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--kv", default="none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    m = load_model(ModelConfig() if a.model == "smollm2" else ModelConfig(source="tiny", name="tiny"))
    batches = [int(b) for b in a.batches.split(",")]
    runs: dict[int, list[float]] = {b: [] for b in batches}
    for k in range(a.rounds):
        for b in (batches if k % 2 == 0 else batches[::-1]):
            runs[b].append(decode_tps(m, b, a.prompt, a.new, a.kv))
            print(json.dumps({"round": k, "batch": b, "decode_tps": runs[b][-1]}), flush=True)
            mx.clear_cache()
    med = {b: statistics.median(v) for b, v in runs.items()}
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "mlx": mx.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a),
              "median_decode_tps": med,
              "gain_over_previous": {b: med[b] / med[p] for p, b in zip(batches, batches[1:])},
              "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
