"""Where more rows stop adding tokens/s: decode tok/s of one engine at several batch sizes.

The ceiling of `engine.max_batch: auto` (engine/batch_limits.py) is the batch past which decode tok/s stops
growing on a backend. Each batch size decodes `--new` tokens for that many rows of `--prompt` tokens (EOS
off); the sizes run in alternating order over `--rounds` rounds, and the median decode tok/s of each is
reported with its ratio to the next smaller size.

    python -m benchmarks engine.batch_ceiling --model smollm2 --batches 16,32,64,128
"""
from __future__ import annotations

import statistics

import mlx.core as mx

from benchmarks import harness as h

SMOKE = ["--model", "tiny", "--batches", "1,2", "--prompt", "8", "--new", "3", "--rounds", "2"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--batches", default="16,32,64,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--kv", default="none", help="a mode: KV mode[@option=value]")
    ap.add_argument("--rounds", type=int, default=2)


def decode_tps(m, batch: int, prompt: int, new: int, mode: str) -> dict:
    model, _, spec = m
    eng = h.engine(model, h.NoEos(), spec, mode, max_batch=batch)
    prompts = [[(17 * i + 3 * j) % 1000 + 10 for j in range(prompt)] for i in range(batch)]
    eng.generate(h.requests(prompts, new, "r"))
    return {"decode_tps": eng.summary()["decode_tokens_per_s"]}


def run(a) -> dict:
    m = h.load(a.model)
    batches = [int(b) for b in a.batches.split(",")]
    sides = {str(b): (lambda b=b: decode_tps(m, b, a.prompt, a.new, a.kv)) for b in batches}
    runs = h.alternate(sides, a.rounds, after=mx.clear_cache)
    med = {b: statistics.median(r["decode_tps"] for r in runs[str(b)]) for b in batches}
    return {"median_decode_tps": med, "gain_over_previous": {b: med[b] / med[p] for p, b in zip(batches, batches[1:])},
            "runs": {b: [r["decode_tps"] for r in runs[str(b)]] for b in batches}}
