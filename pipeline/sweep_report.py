"""The sweep report: sweep.parquet (one row per job) and report.md with PNG plots.

Built at the end of a multirun (pipeline/sweep.py's callback) and again on demand
from one or more sweep folders (`kvbatch action=report report.sweep_dirs=[DIR,...]`).
Everything comes from the job folders: job_status.json (how the job ended, its
overrides and resolved config), summary.json (rows, speed, memory, KV bytes) and
results.parquet (tokens, for agreement against the kv=none job with the same
model, prompts and sampling).
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.engine.errors import ERROR_CODES
from kvbatch.engine.memory import fmt_bytes
from kvbatch.pipeline.sweep import STATUS_FILE, read_status

SWEEP_PARQUET = "sweep.parquet"
REPORT_MD = "report.md"
PLOTS = {
    "decode": ("decode_tokens_per_s.png", "Decode tokens/s by KV mode"),
    "memory": ("peak_memory.png", "Peak memory by KV mode"),
    "agreement": ("agreement.png", "Token agreement with kv=none by KV mode"),
    "errors": ("rows_by_error_code.png", "Rows per error code"),
}
KV_ORDER = {"none": 0, "q8": 1, "q4": 2}
KV_COLORS = {"none": "#4C72B0", "q8": "#DD8452", "q4": "#55A868"}
CODE_COLORS = {"ok": "#55A868", "invalid_input": "#8172B3", "prompt_too_long": "#937860",
               "insufficient_memory": "#C44E52", "non_finite_logits": "#DA8BC3", "internal_error": "#8C8C8C"}

SCHEMA = pa.schema([
    ("sweep_dir", pa.string()), ("job_num", pa.int32()), ("job_dir", pa.string()),
    ("overrides", pa.list_(pa.string())), ("label", pa.string()), ("status", pa.string()),
    ("failure_reason", pa.string()), ("error_type", pa.string()), ("model", pa.string()),
    ("kv_mode", pa.string()), ("memory_budget", pa.string()), ("job", pa.string()),
    ("config_hash", pa.string()), ("compare_key", pa.string()),
    ("rows", pa.int64()), ("rows_ok", pa.int64()), ("rows_remaining", pa.int64()),
    *[(f"rows_{c}", pa.int64()) for c in ERROR_CODES],
    ("output_tokens", pa.int64()), ("decode_tokens_per_s", pa.float64()), ("tokens_per_s", pa.float64()),
    ("peak_memory_bytes", pa.int64()), ("kv_bytes_per_token", pa.int64()), ("route", pa.string()),
    ("wall_s", pa.float64()), ("pid", pa.int64()), ("model_loads", pa.int32()),
    ("baseline_job_dir", pa.string()), ("rows_compared", pa.int64()), ("rows_identical", pa.int64()),
    ("token_agreement", pa.float64()), ("first_divergence_min", pa.int64()),
    ("first_divergence_median", pa.float64()), ("results", pa.string()),
])


# ---- collect -----------------------------------------------------------------------------------
def _pid_alive(pid: Optional[int], host: Optional[str]) -> bool:
    import socket

    import psutil

    if not pid or host != socket.gethostname() or pid == os.getpid():
        return False
    return psutil.pid_exists(pid)


def _expected_jobs(sweep_dir: Path) -> list[list[str]]:
    """The jobs Hydra's basic sweeper planned for this sweep (from multirun.yaml), in job order."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        conf = OmegaConf.load(sweep_dir / "multirun.yaml")
        if "basic_sweeper" not in str(OmegaConf.select(conf, "hydra.sweeper._target_") or ""):
            return []
        task = list(OmegaConf.select(conf, "hydra.overrides.task") or [])
        overrides = OverridesParser.create().parse_overrides(task)
        return BasicSweeper.split_arguments(overrides, None)[0]
    except Exception:  # noqa: BLE001 - unknown sweeper or no multirun.yaml: report the folders found
        return []


def _job_record(status: dict, sweep_dir: Path) -> dict:
    cfg = status.get("config") or {}
    state = status.get("status") or "failed"
    reason = status.get("reason")
    if state == "running" and not _pid_alive(status.get("pid"), status.get("host")):
        state, reason = "failed", "the job's process ended without recording how (killed, or out of memory?)"
    rec: dict[str, Any] = {
        "sweep_dir": str(sweep_dir), "job_num": status.get("job_num"), "job_dir": status.get("job_dir"),
        "overrides": list(status.get("overrides") or []), "status": state, "failure_reason": reason,
        "error_type": status.get("error_type"), "model": (cfg.get("model") or {}).get("name"),
        "kv_mode": (cfg.get("kv") or {}).get("mode") or _override(status, "kv") or _override(status, "kv.mode"),
        "memory_budget": (cfg.get("memory") or {}).get("budget"), "job": (cfg.get("job") or {}).get("name"),
        "config_hash": status.get("config_hash"), "compare_key": status.get("compare_key"),
        "wall_s": status.get("wall_s"), "pid": status.get("pid"), "model_loads": status.get("model_loads"),
        "results": None,
    }
    results = Path(status["job_dir"]) / "results.parquet"
    if results.exists() and state == "completed":
        rec["results"] = str(results)
    summary_path = Path(status["job_dir"]) / "summary.json" if status.get("job_dir") else None
    if summary_path is not None and summary_path.exists() and state == "completed":
        s = json.loads(summary_path.read_text())
        eng = s.get("engine") or {}
        by_code = s.get("rows_by_error_code") or {}
        rec.update(rows=s.get("rows"), rows_ok=s.get("rows_ok"), rows_remaining=s.get("rows_remaining"),
                   output_tokens=s.get("output_tokens"), tokens_per_s=s.get("tokens_per_s"),
                   decode_tokens_per_s=eng.get("decode_tokens_per_s"),
                   peak_memory_bytes=s.get("peak_memory_bytes"), kv_bytes_per_token=eng.get("kv_bytes_per_token"),
                   route=s.get("route"), model=s.get("model") or rec["model"],
                   kv_mode=s.get("kv_mode") or rec["kv_mode"])
        rec.update({f"rows_{c}": int(by_code.get(c, 0)) for c in ERROR_CODES})
    return rec


def _override(status: dict, key: str) -> Optional[str]:
    for o in status.get("overrides") or []:
        k, _, v = o.partition("=")
        if k.lstrip("+~") == key:
            return v
    return None


def collect(sweep_dir: Path) -> list[dict]:
    """One record per job of this sweep folder (jobs planned but never started: status not_run)."""
    sweep_dir = Path(sweep_dir).resolve()
    records = []
    for path in sorted(sweep_dir.rglob(STATUS_FILE)):
        status = read_status(path.parent)
        if status is None:
            continue
        status["job_dir"] = str(path.parent)  # where it is now (a sweep folder may have been moved)
        records.append(_job_record(status, sweep_dir))
    seen = {r["job_num"] for r in records}
    for num, overrides in enumerate(_expected_jobs(sweep_dir)):
        if num not in seen:
            records.append({"sweep_dir": str(sweep_dir), "job_num": num, "overrides": list(overrides),
                            "status": "not_run", "failure_reason": "the sweep stopped before this job started",
                            "kv_mode": _override({"overrides": overrides}, "kv")})
    return sorted(records, key=lambda r: (r["job_num"] is None, r["job_num"] or 0))


# ---- agreement against kv=none ---------------------------------------------------------------------
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


# ---- labels, table -------------------------------------------------------------------------------
def add_labels(records: list[dict]) -> None:
    """Short labels: the job number and the overrides that differ between the jobs."""
    parsed = [dict(o.partition("=")[::2] for o in r.get("overrides") or []) for r in records]
    keys = list(dict.fromkeys(k for p in parsed for k in p))  # in the order the user wrote them
    varying = [k for k in keys if len({p.get(k) for p in parsed}) > 1] or keys
    multi = len({r["sweep_dir"] for r in records}) > 1
    for r, p in zip(records, parsed):
        parts = [f"{k}={p[k]}" for k in varying if k in p]
        prefix = f"{Path(r['sweep_dir']).name}/#{r['job_num']}" if multi else f"#{r['job_num']}"
        r["label"] = " ".join([prefix, *parts])


def to_table(records: list[dict], metadata: dict[str, str]) -> pa.Table:
    rows = [{c: r.get(c) for c in SCHEMA.names} for r in records]
    t = pa.Table.from_pylist(rows, schema=SCHEMA)
    return t.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})


# ---- plots ---------------------------------------------------------------------------------------
def _plot_order(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (KV_ORDER.get(r.get("kv_mode") or "", 9), r["sweep_dir"], r["job_num"] or 0))


def _bars(records: list[dict], field: str, title: str, ylabel: str, path: Path, scale: float = 1.0,
          reference: Optional[float] = None, empty_note: str = "no completed job") -> None:
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
    ax.set_xticklabels([r["label"] for r in jobs], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, top * 1.15)
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
    ax.set_xticklabels([r["label"] for r in jobs], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("rows")
    ax.set_title(PLOTS["errors"][1])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot(records: list[dict], out: Path) -> dict[str, Path]:
    paths = {k: out / name for k, (name, _) in PLOTS.items()}
    _bars(records, "decode_tokens_per_s", PLOTS["decode"][1], "decode tokens/s", paths["decode"])
    _bars(records, "peak_memory_bytes", PLOTS["memory"][1], "peak memory (MiB)", paths["memory"], scale=2**20)
    quant = [r for r in records if r.get("kv_mode") != "none"] or records
    _bars(quant, "token_agreement", PLOTS["agreement"][1], "token agreement (1 = identical)", paths["agreement"],
          reference=1.0, empty_note="no quantized job with a kv=none job of the same model, prompts, sampling")
    _error_plot(records, paths["errors"])
    return paths


# ---- report.md -----------------------------------------------------------------------------------
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
             "| agreement vs kv=none | first divergence (min / median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        div = "–" if r.get("first_divergence_min") is None else \
            f"{r['first_divergence_min']} / {r['first_divergence_median']:g}"
        if r.get("token_agreement") is not None and r.get("rows_identical") == r.get("rows_compared"):
            div = "identical"
        lines.append("| " + " | ".join([
            f"`{r['label']}`", r["status"], _fmt(r.get("model")), _fmt(r.get("kv_mode")),
            f"{_fmt(r.get('rows_ok'))} / {_fmt(r.get('rows'))}", _errors(r), _fmt(r.get("decode_tokens_per_s")),
            _fmt(r.get("peak_memory_bytes"), "bytes"), _fmt(r.get("kv_bytes_per_token"), "bytes"),
            _fmt(r.get("token_agreement"), "ratio"), div]) + " |")
    if bad:
        lines += ["", "## Jobs that did not complete", ""]
        for r in bad:
            lines.append(f"- `{r['label']}` ({' '.join(r.get('overrides') or [])}): **{r['status']}**: "
                         f"{r.get('failure_reason') or 'no reason recorded'}")
    for key, (name, title) in PLOTS.items():
        rel = os.path.relpath(plots[key], out)
        lines += ["", f"## {title}", "", f"![{title}]({rel})"]
    lines += ["", "## How to read it", "",
              "- **decode tok/s**: the engine's decode tokens per second (batched decode steps only; "
              "prefill excluded). Jobs run by the joblib launcher share the machine, so compare speeds "
              "from one-at-a-time (basic launcher) sweeps.",
              "- **peak memory**: MLX's peak allocated memory during the job (weights, KV pages, workspace), "
              "reset at the start of every job and after a model load (the load's transients are not counted).",
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


# ---- entry points --------------------------------------------------------------------------------
def write_report(sweep_dirs: list[Path], out: Path) -> dict:
    """Collect the jobs of these sweep folders; write sweep.parquet, the plots and report.md into `out`."""
    from kvbatch.pipeline.parts import write_atomic
    from kvbatch.pipeline.summary import versions as get_versions

    dirs = [Path(d).resolve() for d in sweep_dirs]
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    records = [r for d in dirs for r in collect(d)]
    add_labels(records)
    add_agreement(records)
    versions = get_versions()
    meta = {"kvbatch.sweep_dirs": json.dumps([str(d) for d in dirs]), "kvbatch.generated_at": str(time.time()),
            **{f"{k}.version": v for k, v in versions.items()}}
    parquet = write_atomic(to_table(records, meta), out / SWEEP_PARQUET)
    plots = plot(records, out)
    md = out / REPORT_MD
    tmp = md.with_name(f".{md.name}.tmp")
    tmp.write_text(markdown(records, dirs, out, plots, versions))
    os.replace(tmp, md)
    done = sum(r["status"] == "completed" for r in records)
    failed = len(records) - done
    line = (f"kvbatch: sweep of {len(records)} jobs: {done} completed"
            + (f", {failed} did not ({', '.join(r['label'] + ': ' + r['status'] for r in records if r['status'] != 'completed')})"
               if failed else "") + f"; report {md}")
    return {"parquet": parquet, "report": md, "plots": plots, "jobs": len(records), "completed": done,
            "failed": failed, "line": line}


def resolve_dirs(patterns: list[str]) -> list[Path]:
    """report.sweep_dirs entries (globs allowed) -> existing sweep folders; ConfigError otherwise."""
    from kvbatch.pipeline.config import ConfigError

    dirs: list[Path] = []
    for p in patterns:
        hits = sorted(glob.glob(os.path.expanduser(str(p)))) or [str(p)]
        for h in hits:
            d = Path(h)
            if not d.is_dir():
                raise ConfigError(f"report.sweep_dirs: {p}: no such folder")
            if not (d / "multirun.yaml").exists() and not any(d.rglob(STATUS_FILE)):
                raise ConfigError(f"report.sweep_dirs: {p}: not a sweep folder (no multirun.yaml or "
                                  f"{STATUS_FILE} inside)")
            if d.resolve() not in dirs:
                dirs.append(d.resolve())
    return dirs


def report_action(cfg) -> Path:
    """`kvbatch action=report report.sweep_dirs=[DIR,...] [report.out=DIR]`."""
    from kvbatch.pipeline.config import ConfigError

    dirs = resolve_dirs(list(cfg.report.sweep_dirs))
    if cfg.report.out:
        out = Path(cfg.report.out)
    elif len(dirs) == 1:
        out = dirs[0]
    else:
        raise ConfigError("report.out: several sweep folders need report.out=DIR (where the combined report goes)")
    res = write_report(dirs, out)
    print(res["line"])
    print(res["parquet"])
    return res["parquet"]
