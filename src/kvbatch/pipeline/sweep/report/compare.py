"""Token agreement of each quantized job against the kv=none job with the same compare key."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import pyarrow.parquet as pq


def _tokens(path: Optional[str]) -> dict[str, list[int]]:
    """row_key -> generated tokens of the rows that ended without an error."""
    if not path or not Path(path).exists():
        return {}
    t = pq.read_table(path, columns=["row_key", "output_token_ids", "error_code"])
    return {k: list(ids or []) for k, ids, code in zip(t.column("row_key").to_pylist(),
                                                      t.column("output_token_ids").to_pylist(),
                                                      t.column("error_code").to_pylist()) if code is None}


def compare(base: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    """Token agreement and first-divergence positions of `other` against `base`, over rows both finished."""
    keys = [k for k in base if k in other]
    matched = total = identical = 0
    firsts: list[int] = []
    for k in keys:
        a, b = base[k], other[k]
        n = min(len(a), len(b))
        same = [x == y for x, y in zip(a[:n], b[:n])]
        matched += sum(same)
        total += max(len(a), len(b))
        if a == b:
            identical += 1
        else:
            firsts.append(same.index(False) if False in same else n)
    return {"rows_compared": len(keys), "rows_identical": identical,
            "token_agreement": (matched / total) if total else (1.0 if keys else None),
            "first_divergence_min": min(firsts) if firsts else None,
            "first_divergence_median": float(statistics.median(firsts)) if firsts else None}


def add_agreement(records: list[dict]) -> None:
    """For each completed quantized job, compare with the kv=none job of the same model, prompts and
    sampling (the same sweep folder first, then the same memory budget, then the lowest job number)."""
    baselines = [r for r in records if r["status"] == "completed" and r.get("kv_mode") == "none"
                 and r.get("compare_key") and r.get("results")]
    cache: dict[str, dict] = {}
    for r in records:
        if r["status"] != "completed" or r.get("kv_mode") in (None, "none") or not r.get("compare_key"):
            continue
        cands = [b for b in baselines if b["compare_key"] == r["compare_key"]]
        if not cands:
            continue
        base = min(cands, key=lambda b: (b["sweep_dir"] != r["sweep_dir"],
                                         b.get("memory_budget") != r.get("memory_budget"), b["job_num"] or 0))
        for p in (base["results"], r["results"]):
            if p not in cache:
                cache[p] = _tokens(p)
        r.update(baseline_job_dir=base["job_dir"], **compare(cache[base["results"]], cache[r["results"]]))
