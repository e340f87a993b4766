"""How many rows run together and how many tokens one prefill pass takes, per backend.

`engine.max_batch: auto` runs as many rows as the memory model admits, up to a ceiling per backend
(below: what it rests on so far). A ceiling still matters: every running row costs host work per
step, and q8/q4 keep one full-precision tail page per batch slot. Where larger batches were measured
faster only while their rows fit, rows past the ceiling join, up to a second ceiling, only while every
running row fits the budget at its worst case (prompt + max_tokens): admitting one never lets the
batch outgrow the budget, so the batch grows where memory holds all of its rows' answers.
`engine.prefill_tokens: auto` is the padded token budget of one prefill pass: large enough that a pass
fills the device, small enough that running rows are not kept waiting long between decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbatch.engine.backend import backend

# rows. MLX CUDA: on the H200 decode tok/s still grew from 64 to 256 rows (1B geometry 10.8k -> 29.6k,
# docs/performance.md). CPU (python -m benchmarks engine.batch_ceiling, SmolLM2, 2 cores): 175 / 228 / 278 decode
# tok/s at 32 / 64 / 128 rows, then 261 -> 269 from 128 to 256 (+3%): 128. Metal: not measured (no Apple machine here).
BATCH_CEILING = {"cpu": 128, "cuda": 256, "metal": 128}
# Rows past BATCH_CEILING, up to this many, while every running row fits the budget at its worst case, for a model
# of at most AT_WORST_MAX_PARAMS parameters. MLX CUDA (H100, docs/performance.md): SmolLM2-135M's rewrite job ran
# 1.46-1.51x faster at 512 rows than at 256 (1,024 rows x 1,024 / 2,048 new tokens): its step is mostly the fixed
# cost of one step (launches, host work), which more rows share. A job of Llama-1B geometry (1.2B parameters, 512
# rows x 2,048 new tokens) ran 0.92x: its step at 256 rows is already bound by reading the rows' K/V and weights,
# so more rows only lengthen it.
BATCH_CEILING_AT_WORST: dict[str, int] = {"cuda": 512}
AT_WORST_MAX_PARAMS = 500_000_000
# CPU: one chunk: matmuls of one 512-token chunk already fill the cores, and padding rows to a shared
# length is compute the CPU pays in full (a 16-row SmolLM2 probe, loaded machine: 52 prompt tok/s batched
# to 2048 vs 72 one row a pass)
PREFILL_TOKENS = {"cpu": 512, "cuda": 8192, "metal": 4096}


@dataclass(frozen=True)
class BatchLimit:
    """How many rows run at once: `rows` batch slots, and why (the plan line says it). at_worst_from: rows past
    this many join only while every running row fits the budget at its worst case (None: no such rule)."""

    rows: int
    why: str
    at_worst_from: Optional[int] = None


def resolve_max_batch(setting: int | str, params: int, name: Optional[str] = None) -> BatchLimit:
    """The batch limit of engine.max_batch for a model of `params` parameters on backend `name` (None: this
    process's backend). A number is the limit as asked; auto is the backend's ceiling, and where it has one and the
    model is small enough, its second ceiling at worst case."""
    if setting != "auto":
        return BatchLimit(int(setting), "engine.max_batch")
    name = name or backend().name
    base, top = BATCH_CEILING[name], BATCH_CEILING_AT_WORST.get(name)
    if top is None:
        return BatchLimit(base, f"auto: the {name} ceiling")
    if params > AT_WORST_MAX_PARAMS:
        return BatchLimit(base, f"auto: the {name} ceiling for a model over {AT_WORST_MAX_PARAMS / 1e9:g}B parameters")
    return BatchLimit(top, f"auto: the {name} ceiling, past {base} only while every row fits at its worst case",
                      base)


def resolve_prefill_tokens(setting: int | str, prefill_chunk: int) -> int:
    """Tokens of one prefill pass for engine.prefill_tokens (auto: never below one row's chunk)."""
    if setting == "auto":
        return max(PREFILL_TOKENS[backend().name], prefill_chunk)
    return int(setting)
