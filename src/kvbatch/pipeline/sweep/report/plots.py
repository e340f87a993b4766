"""The report's PNG bar charts (matplotlib, Agg backend)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvbatch.engine.errors import ERROR_CODES
from kvbatch.pipeline.sweep.report.kv_plots import KV_COLORS, KV_ORDER, kv_memory, quality_vs_memory, zoomed

PLOTS = {
    # one run per job: a single sample each, on a machine that may be busy (no spread to compare against)
    "decode": ("decode_tokens_per_s.png", "Decode tokens/s by KV mode (one run each: a single sample)"),
    "kv_memory": ("kv_memory.png", "KV cache by mode: its peak bytes and the tokens the budget holds"),
    "agreement": ("agreement.png", "Token agreement with kv=none by KV mode"),
    "quality": ("quality_vs_memory.png", "Teacher-forced quality against KV bytes per token and rows that fit"),
    "errors": ("rows_by_error_code.png", "Rows per error code"),
}
__all__ = ["KV_COLORS", "KV_ORDER", "PLOTS", "plot"]
CODE_COLORS = {"ok": "#55A868", "invalid_input": "#8172B3", "prompt_too_long": "#937860",
               "insufficient_memory": "#C44E52", "non_finite_logits": "#DA8BC3", "internal_error": "#8C8C8C"}


def _short(text: str, n: int = 32) -> str:
    """Tick labels that fit under their bar."""
    return text if len(text) <= n else text[: n - 1] + "…"


def _plot_order(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (KV_ORDER.get(r.get("kv_mode") or "", 9), r["sweep_dir"], r["job_num"] or 0))


def _bars(records: list[dict], field: str, title: str, ylabel: str, path: Path, scale: float = 1.0,
          reference: Optional[float] = None, empty_note: str = "no completed job",
          ylim: Optional[tuple[float, float]] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    jobs = _plot_order(records)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(jobs) + 2.5), 4.5), dpi=100)
    xs = list(range(len(jobs)))
    vals = [(r.get(field) or 0) / scale if r.get(field) is not None else 0 for r in jobs]
    colors = [KV_COLORS.get(r.get("kv_mode") or "", "#937860") for r in jobs]
    ax.bar(xs, vals, color=colors, edgecolor="black", linewidth=0.5)
    top = max(vals + [reference or 0, 1e-9])
    for x, r, v in zip(xs, jobs, vals):
        if r.get(field) is None:
            why = r["status"] if r["status"] != "completed" else "n/a"
            ax.text(x, top * 0.02, why, ha="center", va="bottom", rotation=90, fontsize=8, color="#C44E52")
        else:
            text = f"{v:.3f}" if reference is not None else (f"{v:,.0f}" if v >= 100 else f"{v:.3g}")
            ax.text(x, v, text, ha="center", va="bottom", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color=KV_COLORS["none"], linestyle="--", linewidth=1)
        ax.text(len(jobs) - 0.6, reference, "kv=none (reference)", ha="right", va="bottom", fontsize=8,
                color=KV_COLORS["none"])
    if not any(r.get(field) is not None for r in jobs):
        ax.text(0.5, 0.5, empty_note, transform=ax.transAxes, ha="center", va="center", fontsize=11)
    ax.set_xticks(xs)
    ax.set_xticklabels([_short(r["label"]) for r in jobs], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(*(ylim or (0, top * 1.15)))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    modes = sorted({r.get("kv_mode") or "?" for r in jobs}, key=lambda m: KV_ORDER.get(m, 9))
    ax.legend(handles=[Patch(color=KV_COLORS.get(m, "#937860"), label=f"kv={m}") for m in modes],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _error_plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = _plot_order(records)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(jobs) + 2.5), 4.5), dpi=100)
    xs = list(range(len(jobs)))
    bottom = [0.0] * len(jobs)
    for code in ("ok", *ERROR_CODES):
        field = "rows_ok" if code == "ok" else f"rows_{code}"
        vals = [float(r.get(field) or 0) for r in jobs]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=CODE_COLORS[code], label=code, edgecolor="black", linewidth=0.5)
            bottom = [b + v for b, v in zip(bottom, vals)]
    top = max(bottom + [1.0])
    for x, r in zip(xs, jobs):
        if r["status"] != "completed":
            ax.text(x, top * 0.02, f"job {r['status']}", ha="center", va="bottom", rotation=90, fontsize=8,
                    color="#C44E52")
    ax.set_xticks(xs)
    ax.set_xticklabels([_short(r["label"]) for r in jobs], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("rows")
    ax.set_title(PLOTS["errors"][1])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    # the y axis's locator is an AutoLocator (a MaxNLocator: it takes integer=); matplotlib's stub says Locator
    ax.yaxis.get_major_locator().set_params(integer=True)  # pyright: ignore[reportCallIssue]
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot(records: list[dict], out: Path) -> dict[str, Path]:
    """Draw the report's PNG charts into `out`; their paths by name."""
    paths = {k: out / name for k, (name, _) in PLOTS.items()}
    _bars(records, "decode_tokens_per_s", PLOTS["decode"][1], "decode tokens/s", paths["decode"])
    kv_memory(records, paths["kv_memory"], PLOTS["kv_memory"][1])
    quant = [r for r in records if r.get("kv_mode") != "none"] or records
    _bars(quant, "token_agreement", PLOTS["agreement"][1], "token agreement (1 = identical)", paths["agreement"],
          reference=1.0, empty_note="no quantized job with a kv=none job of the same model, prompts, sampling",
          ylim=zoomed([r.get("token_agreement") for r in quant]))
    quality_vs_memory(records, paths["quality"], PLOTS["quality"][1])
    _error_plot(records, paths["errors"])
    return paths
