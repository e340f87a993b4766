"""The ranges of per-row generation values, for the config check and the input reader alike.

Why one place: a value accepted here must fit the results schema (max_tokens and top_k are
int32 columns, seed int64) and the sampler (which scales log-probabilities by 1/temperature:
a temperature near zero overflows float32 and samples garbage without an error). A value
outside these ranges is refused where it is read, so no later stage can choke on it.
"""
from __future__ import annotations

import math

from kvbatch.engine.types import MAX_LOGPROBS

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # the results' seed column is int64 (MLX keys take up to 2**64 - 1)
MIN_TEMPERATURE = 1e-3  # below this (and above 0) 1/T overflows on fp16 logits; use 0 for greedy
MAX_TEMPERATURE = 1e3
MAX_SAMPLES = 4096  # n: samples of one row (queue positions per input row, pipeline/samples.py)


def max_tokens_error(v: int) -> str | None:
    if v < 1:
        return "must be >= 1"
    if v > INT32_MAX:
        return f"must be <= {INT32_MAX} (2**31 - 1)"
    return None


def seed_error(v: int) -> str | None:
    if v < 0:
        return "must be >= 0"
    if v > SEED_MAX:
        return f"must be <= {SEED_MAX} (2**63 - 1)"
    return None


def n_error(v: int) -> str | None:
    if not 1 <= v <= MAX_SAMPLES:
        return f"must be between 1 and {MAX_SAMPLES}"
    return None


def top_k_error(v: int) -> str | None:
    if v < 0:
        return "must be >= 0 (0 = off)"
    if v > INT32_MAX:
        return f"must be <= {INT32_MAX} (2**31 - 1)"
    return None


def top_p_error(v: float) -> str | None:
    if not math.isfinite(v) or not 0 < v <= 1:
        return "must be in (0, 1]"
    return None


def stop_error(v: list) -> str | None:
    if not all(isinstance(x, str) and x for x in v):
        return "must be non-empty strings"
    return None


def temperature_error(v: float) -> str | None:
    if not math.isfinite(v) or v < 0:
        return "must be a finite number >= 0"
    if 0 < v < MIN_TEMPERATURE or v > MAX_TEMPERATURE:
        return f"must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}"
    return None


def min_p_error(v: float) -> str | None:
    if not math.isfinite(v) or not 0 <= v <= 1:
        return "must be in [0, 1] (0 = off)"
    return None


def repetition_penalty_error(v: float) -> str | None:
    if not math.isfinite(v) or v <= 0:
        return "must be a finite number > 0 (1 = off)"
    return None


def penalty_error(v: float) -> str | None:
    if not math.isfinite(v) or not -2 <= v <= 2:
        return "must be in [-2, 2] (0 = off)"
    return None


def min_tokens_error(v: int) -> str | None:
    if v < 0:
        return "must be >= 0"
    if v > INT32_MAX:
        return f"must be <= {INT32_MAX} (2**31 - 1)"
    return None


def logprobs_error(v: int) -> str | None:
    if not 0 <= v <= MAX_LOGPROBS:
        return f"must be in [0, {MAX_LOGPROBS}] (0 = off)"
    return None


def stop_token_ids_error(v: list) -> str | None:
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX for x in v):
        return "must be token ids (integers >= 0)"
    return None
