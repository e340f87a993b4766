"""Writing a report (end of a multirun, or `action=report` over sweep folders)."""
from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

from kvbatch.pipeline.config import ConfigError
from kvbatch.pipeline.parts import write_atomic
from kvbatch.pipeline.summary import versions as get_versions
from kvbatch.pipeline.sweep.report.collect import SWEEP_PARQUET, add_kv_labels, add_labels, collect, to_table
from kvbatch.pipeline.sweep.report.compare import add_agreement
from kvbatch.pipeline.sweep.report.quality import add_quality
from kvbatch.pipeline.sweep.report.markdown import markdown
from kvbatch.pipeline.sweep.report.plots import plot
from kvbatch.pipeline.sweep.status import STATUS_FILE

REPORT_MD = "report.md"


def write_report(sweep_dirs: list[Path], out: Path, teacher_forced: bool = True) -> dict:
    """Collect the jobs of these sweep folders; write sweep.parquet, the plots and report.md into `out`.
    teacher_forced: score each quantized job on its kv=none partner's outputs (quality.py; loads the model)."""
    dirs = [Path(d).resolve() for d in sweep_dirs]
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    records = [r for d in dirs for r in collect(d)]
    add_labels(records)
    add_kv_labels(records)
    add_agreement(records)
    if teacher_forced:
        add_quality(records)
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
    not_done = ", ".join(f"{r['label']}: {r['status']}" for r in records if r["status"] != "completed")
    line = (f"kvbatch: sweep of {len(records)} jobs: {done} completed"
            + (f", {failed} did not ({not_done})" if failed else "") + f"; report {md}")
    return {"parquet": parquet, "report": md, "plots": plots, "jobs": len(records), "completed": done,
            "failed": failed, "line": line}


def resolve_dirs(patterns: list[str]) -> list[Path]:
    """report.sweep_dirs entries (globs allowed) -> existing sweep folders; ConfigError otherwise."""
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
    dirs = resolve_dirs(list(cfg.report.sweep_dirs))
    if cfg.report.out:
        out = Path(cfg.report.out)
    elif len(dirs) == 1:
        out = dirs[0]
    else:
        raise ConfigError("report.out: several sweep folders need report.out=DIR (where the combined report goes)")
    res = write_report(dirs, out, cfg.report.teacher_forced)
    print(res["line"])
    print(res["parquet"])
    return res["parquet"]
