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


def markdown(records: list[dict], sweep_dirs: list[Path], out: Path, plots: dict[str, Path],
             versions: dict[str, str]) -> str:
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
             "| KV peak | tokens that fit | agreement vs kv=none | first divergence (min / median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        div = "–" if r.get("first_divergence_min") is None else \
            f"{r['first_divergence_min']} / {r['first_divergence_median']:g}"
        if r.get("token_agreement") is not None and r.get("rows_identical") == r.get("rows_compared"):
            div = "identical"
        lines.append("| " + " | ".join([
            f"`{r['label']}`", r["status"], _fmt(r.get("model")), _fmt(r.get("kv_mode")),
            f"{_fmt(r.get('rows_ok'))} / {_fmt(r.get('rows'))}", _errors(r), _fmt(r.get("decode_tokens_per_s")),
            _fmt(r.get("peak_memory_bytes"), "bytes"), _fmt(r.get("kv_bytes_per_token"), "bytes"),
            _fmt(r.get("kv_peak_bytes"), "bytes"), _fmt(r.get("kv_tokens_fit")),
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
              "from one-at-a-time (basic launcher) sweeps.",
              "- **peak memory**: MLX's peak allocated memory during the job (weights, KV pages, workspace), "
              "reset at the start of every job and after a model load (the load's transients are not counted). "
              "On a small model the weights dominate it, so it does not show what a KV mode saves: read "
              "**KV peak** (the KV cache's own pages at its peak) and **tokens that fit** (the tokens of "
              "context the budget holds next to the weights in that mode: rows x context, before workspace).",
              "- **KV bytes/token**: cache bytes per token over all layers, K and V, with the scales and "
              "biases of quantized modes.",
              "- **agreement vs kv=none**: compared with the kv=none job of the same model, prompts and "
              "sampling, over rows both finished without an error: the share of token positions where "
              "both outputs hold the same token (positions up to the longer output; 1 = identical). "
              "**first divergence**: the first token position where a row's output differs (min and "
              "median over the rows that differ).",
              "- **errors**: rows per error code (see the README's error codes); a job that did not "
              "complete has no rows."]
    return "\n".join(lines) + "\n"
