"""How many rows run together and how many tokens one prefill pass takes, per backend.

`engine.max_batch: auto` runs as many rows as the memory model admits, up to a ceiling per backend
(below: what it rests on so far). A ceiling still matters: every running row costs host work per
step, and q8/q4 keep one full-precision tail page per batch slot. `engine.prefill_tokens: auto` is
the padded token budget of one prefill pass: large enough that a pass fills the device, small enough that running rows
are not kept waiting long between decode steps.
"""
from __future__ import annotations

from kvbatch.engine.backend import backend

# rows. MLX CUDA: on the H200 decode tok/s still grew from 64 to 256 rows (1B geometry 10.8k -> 29.6k,
# docs/performance.md); a small model gains beyond (SmolLM2's rewrite job, 1,024 x 2,048 on an H200: 1.33-1.55x
# the tok/s at 512 rows, slower at 1,024), but 1B/8B are not measured past 256, q8/q4 price a tail page per batch
# slot (8B: 8.4 MB each), and long answers fill an 80 GB card's KV budget before 512 rows do (the same job at
# 2,048 x 4,096 on an H100: 17.6k tok/s at 256 rows, 15.0k at 512; benchmarks/notebook), so larger batches are
# asked for by number (engine.max_batch=512).
# CPU (python -m benchmarks engine.batch_ceiling, SmolLM2, 2 cores): 175 / 228 / 278 decode tok/s at 32 / 64 / 128 rows,
# then 261 -> 269 from 128 to 256 (+3%): 128.
# Metal: not measured (no Apple machine here).
BATCH_CEILING = {"cpu": 128, "cuda": 256, "metal": 128}
# CPU: one chunk: matmuls of one 512-token chunk already fill the cores, and padding rows to a shared
# length is compute the CPU pays in full (a 16-row SmolLM2 probe, loaded machine: 52 prompt tok/s batched
# to 2048 vs 72 one row a pass)
PREFILL_TOKENS = {"cpu": 512, "cuda": 8192, "metal": 4096}


def resolve_max_batch(setting: int | str) -> tuple[int, str]:
    """(rows, why) for engine.max_batch."""
    if setting != "auto":
        return int(setting), "engine.max_batch"
    name = backend().name
    return BATCH_CEILING[name], f"auto: the {name} ceiling"


def resolve_prefill_tokens(setting: int | str, prefill_chunk: int) -> int:
    """Tokens of one prefill pass for engine.prefill_tokens (auto: never below one row's chunk)."""
    if setting == "auto":
        return max(PREFILL_TOKENS[backend().name], prefill_chunk)
    return int(setting)
