"""Two runs' engine figures (Engine.stats(): summary.json's "engine") as one run's.

Worker processes side by side (`worker.processes`, `at_once`) each report their own engine; so does a job's second
pass after its first (lost parts generated again). summary.json shows one engine for the run, so the figures are
merged by what each one is: the configuration is the same in every worker; counts add up; sizes (budgets, pools,
slots) and peaks add up for engines side by side (they held memory at the same time) and take the larger one after
the other; times are the longer worker's side by side and add up one after the other; a rate adds up side by side
(both engines produced tokens at once) and is the time-weighted mean one after the other; ratios are computed again.
"""
from __future__ import annotations

from typing import Any

# what describes the engine's configuration, not what it did: the same in every worker of a job
CONFIG = frozenset({
    "kv_mode", "route", "page_size", "kv_k_axis", "group_size", "kv_label", "key_bits", "value_bits", "rotate_keys",
    "full_precision_tokens", "kv_bytes_per_token", "page_bytes", "weights_bytes", "max_batch_why", "admission",
    "prefix_cache", "lookahead", "options", "speculative", "ngram_search", "spec_chain"})
# the state at the end of a run: side by side they add up, one after the other the later one's stands
STATE = frozenset({"pages_in_use", "pages_free", "rows_running", "rows_waiting", "pages_cached",
                   "pages_evictable", "decode_in_flight"})
# the largest of one pass, not a total: the larger either way
LARGEST = frozenset({"prefill_rows_max"})
# what an engine holds or may hold (memory, pages, slots): side by side they add up, one after the other the larger
SIZES = frozenset({"budget_bytes", "pool_capacity_pages", "pool_bytes", "kv_tail_bytes", "max_batch",
                   "spec_draft_pool_bytes"})
# a rate, and the time it is a rate over
RATES = {"decode_tokens_per_s": "decode_s", "prefill_tokens_per_s": "prefill_s"}
# a ratio, from the totals it divides
RATIOS = {"spec_acceptance": ("spec_accepted", "spec_proposed")}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def merge(a: dict, b: dict, at_once: bool) -> dict:
    """`a` and `b` as one run's figures; either may be empty (a worker that never built an engine)."""
    if not a or not b:
        return dict(a or b)
    out = {key: _one(key, a.get(key), b.get(key), at_once) for key in {**a, **b}
           if key not in RATES and key not in RATIOS}
    for key, time_key in RATES.items():  # once the totals they come from are merged
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            out[key] = y if x is None else x
        elif at_once:
            out[key] = x + y
        else:
            tx, ty = a.get(time_key) or 0.0, b.get(time_key) or 0.0
            out[key] = (x * tx + y * ty) / (tx + ty) if tx + ty else None
    for key, (num, den) in RATIOS.items():
        if key in a or key in b:
            out[key] = out[num] / out[den] if out.get(den) else None
    return out


def _one(key: str, x: Any, y: Any, at_once: bool) -> Any:
    """One figure of two runs (`x` the first's, `y` the second's) as one run's."""
    if x is None or y is None:
        return y if x is None else x
    if key in CONFIG:
        return x
    if key in STATE:
        return x + y if at_once else y
    if isinstance(x, list) and isinstance(y, list):
        return x + y
    if isinstance(x, dict) and isinstance(y, dict):
        return {k: x.get(k, 0) + y.get(k, 0) for k in {**x, **y}}
    if not (_number(x) and _number(y)):
        return y  # neither a count nor a size nor a time: the later one's
    if key in LARGEST or (not at_once and (key in SIZES or "peak" in key)) or (at_once and key.endswith("_s")):
        return max(x, y)
    return x + y
