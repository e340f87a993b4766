"""The report's memory and quality-versus-memory charts, one facet per model.

A job's peak memory is mostly its weights on a small model, so it shows q8/q4 no better (or worse)
than none; what a user choosing a KV mode needs is the KV cache's own bytes and how much context
the budget holds in each mode, and what each mode costs in agreement with kv=none per byte saved.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

KV_ORDER = {"none": 0, "q8": 1, "q4": 2}
KV_COLORS = {"none": "#4C72B0", "q8": "#DD8452", "q4": "#55A868"}


def _models(records: list[dict]) -> list[str]:
    return sorted({r.get("model") or "?" for r in records})


def _short(text: str, n: int = 28) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def agreement_limits(values: list[float]) -> tuple[float, float]:
    """The agreement axis zoomed to the data (1 = identical stays in view), never below 0."""
    if not values:
        return 0.0, 1.05
    lo = min(values + [1.0])
    pad = max((1.0 - lo) * 0.15, 0.005)
    return max(lo - pad, 0.0), 1.0 + pad


def _figure(ncols: int, nrows: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(max(5.0, 4.2 * ncols), 3.6 * nrows), dpi=100, squeeze=False)
    return plt, fig, axes


def kv_memory(records: list[dict], path: Path, title: str) -> None:
    """Top: the KV cache's peak bytes per job; bottom: tokens of context the budget holds per job."""
    done = [r for r in records if r.get("kv_bytes_per_token")]
    models = _models(done) or ["(no completed job)"]
    plt, fig, axes = _figure(len(models), 2)
    for col, model in enumerate(models):
        jobs = sorted((r for r in done if (r.get("model") or "?") == model),
                      key=lambda r: (KV_ORDER.get(r.get("kv_mode") or "", 9), r.get("job_num") or 0))
        labels = [_short(r.get("label") or r.get("kv_mode") or "?", 22) for r in jobs]
        colors = [KV_COLORS.get(r.get("kv_mode") or "", "#937860") for r in jobs]
        most = max([r.get("kv_tokens_fit") or 0 for r in jobs] + [0])
        fit_scale, fit_unit = (1e6, "millions") if most >= 1e6 else (1e3, "thousands") if most >= 1e3 else (1, "")
        fit_label = f"tokens that fit the budget ({fit_unit})" if fit_unit else "tokens that fit the budget"
        for row, (field, scale, ylabel) in enumerate((("kv_peak_bytes", 2**20, "KV cache peak (MiB)"),
                                                      ("kv_tokens_fit", fit_scale, fit_label))):
            ax = axes[row][col]
            vals = [(r.get(field) or 0) / scale for r in jobs]
            xs = list(range(len(jobs)))
            ax.bar(xs, vals, color=colors, edgecolor="black", linewidth=0.5)
            for x, r, v in zip(xs, jobs, vals):
                note = (f"{v:,.0f}" if v >= 100 else f"{v:.3g}") + \
                    (f"\n{r['kv_bytes_per_token']:,} B/tok" if row == 0 else "")
                ax.text(x, v, note, ha="center", va="bottom", fontsize=7)
            ax.set_ylim(0, max(vals + [1e-9]) * 1.3)
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(ylabel, fontsize=8)
            if row == 0:
                ax.set_title(_short(model, 40), fontsize=9)
        if not jobs:
            axes[0][col].text(0.5, 0.5, "no completed job", transform=axes[0][col].transAxes, ha="center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


PALETTE = ("#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")


def label_color(label: str, labels: list[str]) -> str:
    """A mode's colour: the fixed ones for none/q8/q4, others (kvmodes' new modes, layout variants) from a
    palette in label order, so a sweep never needs a list of modes here."""
    if label in KV_COLORS:
        return KV_COLORS[label]
    others = sorted(x for x in set(labels) if x not in KV_COLORS)
    return PALETTE[others.index(label) % len(PALETTE)] if label in others else "#937860"


QUALITY_PANELS = (  # (y field, y label, x field, x label, x scale)
    ("tf_top1_agreement", "top-1 agreement with kv=none\n(teacher-forced)", "kv_bytes_per_token",
     "KV bytes per token (KiB)", 1024),
    ("tf_kl_mean", "mean KL(none || mode), nats\n(teacher-forced, log scale)", "kv_bytes_per_token",
     "KV bytes per token (KiB)", 1024),
    ("tf_top1_agreement", "top-1 agreement with kv=none\n(teacher-forced)", "kv_rows_fit",
     "rows of this job that fit the KV budget at once", 1),
)


def quality_vs_memory(records: list[dict], path: Path, title: str) -> None:
    """Teacher-forced quality against KV bytes per token and against rows that fit, one point per job
    (labelled by its KV mode), one column of panels per model; kv=none is the reference (top-1 1, KL 0)."""
    done = [r for r in records if r.get("status") == "completed" and r.get("kv_bytes_per_token")]
    points = [r for r in done if r.get("kv_mode") == "none" or r.get("tf_top1_agreement") is not None]
    models = _models(points) or ["(no job to compare)"]
    labels = [r.get("kv_label") or r.get("kv_mode") or "?" for r in points]
    plt, fig, axes = _figure(len(models), len(QUALITY_PANELS))
    for col, model in enumerate(models):
        mine = [r for r in points if (r.get("model") or "?") == model]
        for row, (yf, ylabel, xf, xlabel, xscale) in enumerate(QUALITY_PANELS):
            ax = axes[row][col]
            log = yf == "tf_kl_mean"
            pts = []
            for r in mine:
                y = (0.0 if log else 1.0) if r.get("kv_mode") == "none" else r.get(yf)
                x = r.get(xf)
                if x is None or y is None or (log and y <= 0):
                    continue
                lab = r.get("kv_label") or r.get("kv_mode") or "?"
                pts.append((x / xscale, y))
                ax.scatter([x / xscale], [y], s=60, color=label_color(lab, labels), edgecolor="black",
                           linewidth=0.5, zorder=3)
                ax.annotate(lab, (x / xscale, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
            if log:
                ax.set_yscale("log")
                ax.text(0.02, 0.02, "kv=none: KL 0 (not drawn on a log scale)", transform=ax.transAxes,
                        fontsize=7, color=KV_COLORS["none"])
            else:
                ax.set_ylim(*agreement_limits([y for _, y in pts]))
                ax.axhline(1.0, color=KV_COLORS["none"], linestyle="--", linewidth=0.8)
            ax.set_xlim(0, max([x for x, _ in pts] + [1e-9]) * 1.3)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            if row == 0:
                ax.set_title(_short(model, 40), fontsize=9)
            if not pts:
                ax.text(0.5, 0.5, "no quantized job scored against a kv=none job", transform=ax.transAxes,
                        ha="center", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def zoomed(values: list[Optional[float]]) -> tuple[float, float]:
    """agreement_limits over the values that exist."""
    return agreement_limits([v for v in values if v is not None])
