"""report.md: the jobs table, the jobs that did not complete, the plots, how to read them."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvbatch.engine.errors import ERROR_CODES
from kvbatch.engine.sizes import fmt_bytes
from kvbatch.pipeline.sweep.report.collect import SWEEP_PARQUET
from kvbatch.pipeline.sweep.report.plots import PLOTS


def _fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "–"
    if kind == "bytes":
        return fmt_bytes(int(v))
    if kind == "ratio":
        return f"{v:.3f}"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def _errors(r: dict) -> str:
    parts = [f"{c} {r.get(f'rows_{c}')}" for c in ERROR_CODES if r.get(f"rows_{c}")]
    return ", ".join(parts) or ("0" if r["status"] == "completed" else "–")


def _quality(r: dict) -> list[str]:
    """The teacher-forced cells: top-1, mean KL (worst row's mean), perplexity (kv=none's)."""
    if r.get("tf_top1_agreement") is None:
        why = r.get("tf_error")
        return [f"– ({why[:60]})" if why else "–", "–", "–"]
    return [f"{r['tf_top1_agreement']:.4f}", f"{r['tf_kl_mean']:.2e} ({r['tf_kl_row_max']:.2e})",
            f"{r['tf_ppl']:.3f} ({r['tf_ppl_baseline']:.3f})"]


def markdown(records: list[dict], sweep_dirs: list[Path], out: Path, plots: dict[str, Path],
             versions: dict[str, str]) -> str:
    """The text of report.md: the jobs table, the jobs that did not complete, the plots and how to read them."""
    done = [r for r in records if r["status"] == "completed"]
    bad = [r for r in records if r["status"] != "completed"]
    lines = ["# kvbatch sweep report", "",
             f"Sweep folder{'s' if len(sweep_dirs) > 1 else ''}: " + ", ".join(f"`{d}`" for d in sweep_dirs),
             "",
             f"{len(records)} jobs: {len(done)} completed, {len(bad)} not completed. "
             f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by kvbatch {versions.get('kvbatch', '?')} "
             f"(mlx {versions.get('mlx', '?')}, mlx-lm {versions.get('mlx-lm', '?')}). "
             f"One row per job in `{SWEEP_PARQUET}`.", "",
             "## Jobs", "",
             "| job | status | model | kv | rows ok | errors | decode tok/s | peak memory | KV bytes/token "
             "| KV peak | tokens that fit | top-1 vs kv=none (teacher-forced) | mean KL (worst row) "
             "| perplexity (kv=none's) | free-running agreement | first divergence (min / median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        div = "–" if r.get("first_divergence_min") is None else \
            f"{r['first_divergence_min']} / {r['first_divergence_median']:g}"
        if r.get("token_agreement") is not None and r.get("rows_identical") == r.get("rows_compared"):
            div = "identical"
        lines.append("| " + " | ".join([
            f"`{r['label']}`", r["status"], _fmt(r.get("model")), _fmt(r.get("kv_label") or r.get("kv_mode")),
            f"{_fmt(r.get('rows_ok'))} / {_fmt(r.get('rows'))}", _errors(r), _fmt(r.get("decode_tokens_per_s")),
            _fmt(r.get("peak_memory_bytes"), "bytes"), _fmt(r.get("kv_bytes_per_token"), "bytes"),
            _fmt(r.get("kv_peak_bytes"), "bytes"), _fmt(r.get("kv_tokens_fit")), *_quality(r),
            _fmt(r.get("token_agreement"), "ratio"), div]) + " |")
    if bad:
        lines += ["", "## Jobs that did not complete", ""]
        for r in bad:
            lines.append(f"- `{r['label']}` ({' '.join(r.get('overrides') or [])}): **{r['status']}**: "
                         f"{r.get('failure_reason') or 'no reason recorded'}")
    for key, (_, title) in PLOTS.items():
        rel = os.path.relpath(plots[key], out)
        lines += ["", f"## {title}", "", f"![{title}]({rel})"]
    lines += ["", "## How to read it", "",
              "- **decode tok/s**: the engine's decode tokens per second (batched decode steps only; "
              "prefill excluded). Jobs run by the joblib launcher share the machine, so compare speeds "
              "from one-at-a-time (basic launcher) sweeps. Each figure is one run of its job, a single "
              "sample: differences of a few percent are within a busy machine's noise (run the sweep again "
              "to see the spread).",
              "- **peak memory**: MLX's peak allocated memory during the job (weights, KV pages, workspace), "
              "reset at the start of every job and after a model load (the load's transients are not counted). "
              "On a small model the weights dominate it, so it does not show what a KV mode saves: read "
              "**KV peak** (the KV cache's own pages at its peak) and **tokens that fit** (the tokens of "
              "context the budget holds next to the weights in that mode: rows x context, before workspace).",
              "- **KV bytes/token**: cache bytes per token over all layers, K and V, with the scales and "
              "biases of quantized modes.",
              "- **Quality: read the teacher-forced columns first.** Each quantized job is scored on the "
              "outputs of the kv=none job of the same model, prompts and sampling: both caches are fed "
              "those same tokens, and at every position their next-token distributions are compared. "
              "**top-1 vs kv=none**: the share of positions where both put the same token first "
              "(1 = never differs). **mean KL**: KL(kv=none || mode) in nats, the mean over positions, "
              "and in brackets the worst row's mean (0 = the same distribution; the lower, the closer; "
              "this sweep's own values are in the table). **perplexity**: of the kv=none text under the mode's cache, "
              "with kv=none's own in brackets (the mode's is higher by what it loses). Per row: "
              "`teacher_forced.parquet` in the job's folder. The plot `quality_vs_memory.png` puts "
              "these against KV bytes per token and against the rows of the job that fit the budget: "
              "the best mode is up and to the left (top-1 near 1 at few bytes), or up and right in "
              "rows that fit.",
              "- **free-running agreement** (secondary): the share of token positions where the two jobs' "
              "own outputs hold the same token (over rows both finished; positions up to the longer "
              "output). One near-tie flip early in an answer makes the rest of it differ, so this "
              "understates a mode that is almost always right; **first divergence**: the first token "
              "position where a row's output differs (min and median over the rows that differ).",
              "- **errors**: rows per error code (see docs/errors.md); a job that did not "
              "complete has no rows."]
    return "\n".join(lines) + "\n"
