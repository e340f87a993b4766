"""summary.json and the one-line summary printed at the end of a run."""
from __future__ import annotations

import importlib.metadata
import json
import os
import resource
import sys
from pathlib import Path
from typing import Optional

import pyarrow as pa

from kvbatch.engine.sizes import fmt_bytes
from kvbatch.pipeline.parts import fsync_dir, temp_path


def versions() -> dict[str, str]:
    """Installed versions of kvbatch, mlx and mlx-lm ("unknown" when not installed)."""
    out = {}
    for dist in ("kvbatch", "mlx", "mlx-lm"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "unknown"
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident memory (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# the results columns build() reads (finalize reads only these back)
COLUMNS = ("error_code", "prompt_tokens", "cached_tokens", "output_tokens", "preemptions", "spec_proposed",
           "spec_accepted", "resumed_tokens")


def build(table: pa.Table, counts: dict[str, int], sessions: list[dict], this_run: Optional[dict],
          extra: dict) -> dict:
    """Rows ok / per error code from the results; speed, memory and route from the work sessions."""
    import pyarrow.compute as pc

    by_code: dict[str, int] = {}
    if table.num_rows:
        for item in pc.value_counts(table.column("error_code")).to_pylist():  # pyright: ignore[reportAttributeAccessIssue]
            if item["values"] is not None:
                by_code[item["values"]] = int(item["counts"])

    def col(name: str) -> int:
        """The column's sum (0 for a column results written before it existed lack)."""
        assert name in COLUMNS, f"{name}: summary.COLUMNS lists the columns the summary reads"
        if not table.num_rows or name not in table.column_names:
            return 0
        return int(pc.sum(table.column(name)).as_py() or 0)  # pyright: ignore[reportAttributeAccessIssue]

    worked = [s for s in sessions if s.get("tokens") and s.get("wall_s")]  # ended cleanly
    last = next((s["summary"] for s in reversed(sessions) if s.get("summary")), None) or {}
    run = this_run or {}
    # this run's engine (its worker processes' together: pipeline/engine_stats.py), else the last run's
    engine = run.get("engine") or last
    total_tokens = sum(s["tokens"] for s in worked)
    total_wall = sum(s["wall_s"] or 0 for s in worked)
    run_tps = (run["tokens"] / run["wall_s"]) if run.get("wall_s") and run.get("tokens") else None
    return {
        **extra,
        "rows": table.num_rows,
        "rows_ok": table.num_rows - sum(by_code.values()),
        "rows_by_error_code": by_code,
        "rows_remaining": counts.get("pending", 0) + counts.get("leased", 0),
        "prompt_tokens": col("prompt_tokens"),
        # prefix caching and n samples: prompt tokens taken from cached or shared pages, and those computed
        "prompt_tokens_cached": col("cached_tokens"),
        "prompt_tokens_prefilled": col("prompt_tokens") - col("cached_tokens"),
        "output_tokens": col("output_tokens"),
        "preemptions": col("preemptions"),  # engine.admission=optimistic: rows' pages freed and recomputed
        # speculative decoding: tokens proposed, accepted, and the share accepted (null: nothing proposed)
        "spec_proposed": col("spec_proposed"),
        "spec_accepted": col("spec_accepted"),
        "spec_acceptance": col("spec_accepted") / col("spec_proposed") if col("spec_proposed") else None,
        "this_run": {"rows": run.get("rows", 0), "generated_tokens": run.get("tokens", 0),
                     "wall_s": run.get("wall_s", 0.0),
                     "tokens_per_s": run_tps,
                     # MLX's peak (weights, KV, workspace) in this run; None: nothing generated
                     "peak_memory_bytes": run.get("peak_memory_bytes"),
                     # output tokens rows continued from (checkpoints of earlier runs), and tokens this run
                     # generated beyond the last checkpoint of rows it handed back, or (as their lease heartbeat
                     # recorded it) by a dead worker whose rows it took over: generated again
                     "tokens_carried_over": run.get("resumed_tokens", 0), "tokens_lost": run.get("lost_tokens", 0),
                     "checkpoints": run.get("checkpoints", 0), "checkpoint_s": run.get("checkpoint_s", 0.0),
                     # of the tokens carried over, those whose K/V pages were loaded from kv/ instead of
                     # prefilled; tokens whose K/V pages this run kept at its stop, and the time it took
                     "kv_restored_tokens": run.get("kv_restored_tokens", 0),
                     "kv_kept_tokens": run.get("kv_kept_tokens", 0), "kv_save_s": run.get("kv_save_s", 0.0)},
        "resumed_tokens": col("resumed_tokens"),  # results' output tokens carried over from checkpoints
        "tokens_per_s": total_tokens / total_wall if total_wall else None,
        "kv_mode": engine.get("kv_mode", extra.get("kv_mode")),
        "route": engine.get("route"),
        # MLX's peak over every run of the job (this_run.peak_memory_bytes: this run's)
        "peak_memory_bytes": max([s["summary"].get("mlx_peak_memory_bytes", 0) for s in sessions
                                  if s.get("summary")] or [0]) or None,
        # this process's peak resident memory (the OS's count), and its worker processes' (worker.processes)
        "peak_rss_bytes": peak_rss_bytes() + run.get("workers_rss_bytes", 0),
        "engine": engine or None,
        "sessions": [{k: s[k] for k in ("worker", "started_at", "ended_at", "rows", "tokens", "wall_s")}
                     for s in sessions],
    }


def write(path: Path, summary: dict) -> None:
    """Write summary.json atomically and durably (a temporary file, fsynced, then renamed)."""
    tmp = temp_path(path)
    with open(tmp, "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def failure(s: dict, max_error_fraction: Optional[float]) -> Optional[str]:
    """Why a run whose results are written still failed (exit 1), or None: no row succeeded, or more
    than `max_error_fraction` of the rows ended with an error code. Rows without a result yet
    (a deadline) do not count; a job with no results (empty input, nothing done yet) does not fail."""
    rows, ok = s["rows"], s["rows_ok"]
    if not rows:
        return None
    bad = rows - ok
    codes = ", ".join(f"{c} {n}" for c, n in sorted(s["rows_by_error_code"].items()))
    if not ok:
        return f"no row succeeded: {bad} of {rows} rows ended with an error code ({codes})"
    if max_error_fraction is not None and bad / rows > max_error_fraction:
        return (f"{bad} of {rows} rows ({bad / rows:.0%}) ended with an error code ({codes}), more than "
                f"output.max_error_fraction={max_error_fraction}")
    return None


def one_line(s: dict) -> str:
    """The summary in one line for the terminal: rows, tokens, speed, KV mode, route, this run's MLX peak, BLAS."""
    errs = ", ".join(f"{n} {c}" for c, n in sorted(s["rows_by_error_code"].items()))
    run = s["this_run"]
    speed = f"{run['tokens_per_s']:.1f} tok/s" if run["tokens_per_s"] else "nothing generated this run"
    peak = run.get("peak_memory_bytes")
    mem = f", MLX peak {fmt_bytes(peak)} this run" if peak else ""
    rest = f", {s['rows_remaining']} remaining" if s["rows_remaining"] else ""
    if s.get("spec_acceptance") is not None:
        speed += f", spec acceptance {s['spec_acceptance']:.0%}"
    kv = f" (K/V of {run['kv_restored_tokens']} tokens loaded, not prefilled)" if run.get("kv_restored_tokens") else ""
    kept = (f", {run['tokens_carried_over']} carried over from checkpoints{kv}, {run['tokens_lost']} lost"
            if run.get("tokens_carried_over") or run.get("tokens_lost") else "")
    # the job's rows so far, then what this run did (a resumed job's earlier runs are in summary.json)
    return (f"kvbatch: {s['rows']} rows ({s['rows_ok']} ok{', ' + errs if errs else ''}){rest}; "
            f"this run: {run['rows']} rows, {run['generated_tokens']} tokens in {run['wall_s']:.1f}s ({speed}){kept}; "
            f"kv={s['kv_mode']} route={s['route'] or '-'}{mem}; blas={s.get('blas', '-')}")
