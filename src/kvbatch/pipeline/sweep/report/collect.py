"""One record per job of a sweep folder, read from its job folders; the sweep.parquet schema."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from kvbatch.engine.errors import ERROR_CODES
from kvbatch.pipeline import procs
from kvbatch.pipeline.redact import redact_override
from kvbatch.pipeline.sweep.status import STATUS_FILE, read_status

SWEEP_PARQUET = "sweep.parquet"
SCHEMA = pa.schema([
    ("sweep_dir", pa.string()), ("job_num", pa.int32()), ("job_dir", pa.string()),
    ("overrides", pa.list_(pa.string())), ("label", pa.string()), ("status", pa.string()),
    ("failure_reason", pa.string()), ("error_type", pa.string()), ("model", pa.string()),
    ("kv_mode", pa.string()), ("kv_label", pa.string()), ("memory_budget", pa.string()), ("job", pa.string()),
    ("config_hash", pa.string()), ("compare_key", pa.string()),
    ("rows", pa.int64()), ("rows_ok", pa.int64()), ("rows_remaining", pa.int64()),
    *[(f"rows_{c}", pa.int64()) for c in ERROR_CODES],
    ("output_tokens", pa.int64()), ("decode_tokens_per_s", pa.float64()), ("tokens_per_s", pa.float64()),
    ("spec_acceptance", pa.float64()),  # speculative decoding: tokens accepted / proposed
    ("peak_memory_bytes", pa.int64()), ("kv_bytes_per_token", pa.int64()), ("kv_peak_bytes", pa.int64()),
    ("kv_budget_bytes", pa.int64()), ("kv_tokens_fit", pa.int64()), ("kv_rows_fit", pa.int64()), ("route", pa.string()),
    ("wall_s", pa.float64()), ("pid", pa.int64()), ("model_loads", pa.int32()),
    ("baseline_job_dir", pa.string()), ("rows_compared", pa.int64()), ("rows_identical", pa.int64()),
    ("token_agreement", pa.float64()), ("first_divergence_min", pa.int64()),
    ("first_divergence_median", pa.float64()),
    ("tf_rows", pa.int64()), ("tf_positions", pa.int64()), ("tf_kl_mean", pa.float64()),
    ("tf_kl_row_max", pa.float64()), ("tf_kl_max", pa.float64()), ("tf_top1_agreement", pa.float64()),
    ("tf_ppl", pa.float64()), ("tf_ppl_baseline", pa.float64()), ("tf_error", pa.string()),
    ("results", pa.string()),
])



def _still_running(status: dict) -> bool:
    """A job recorded as running whose process is gone ended without saying how. This process
    is never it: the report runs after every job of its own multirun returned."""
    pid = status.get("pid")
    return not procs.is_me(pid) and procs.alive(pid, host=status.get("host"))


def _expected_jobs(sweep_dir: Path) -> list[list[str]]:
    """The jobs Hydra's basic sweeper planned for this sweep (from multirun.yaml), in job order."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        conf = OmegaConf.load(sweep_dir / "multirun.yaml")
        if "basic_sweeper" not in str(OmegaConf.select(conf, "hydra.sweeper._target_") or ""):
            return []
        task = [redact_override(o) for o in OmegaConf.select(conf, "hydra.overrides.task") or []]
        overrides = OverridesParser.create().parse_overrides(task)
        return BasicSweeper.split_arguments(overrides, None)[0]
    except Exception:  # noqa: BLE001 - unknown sweeper or no multirun.yaml: report the folders found
        return []


def _job_record(status: dict, sweep_dir: Path) -> dict:
    cfg = status.get("config") or {}
    state = status.get("status") or "failed"
    reason = status.get("reason")
    if state == "running" and not _still_running(status):
        state, reason = "failed", "the job's process ended without recording how (killed, or out of memory?)"
    rec: dict[str, Any] = {
        "sweep_dir": str(sweep_dir), "job_num": status.get("job_num"), "job_dir": status.get("job_dir"),
        "overrides": [redact_override(o) for o in status.get("overrides") or []],
        "status": state, "failure_reason": reason,
        "error_type": status.get("error_type"), "model": (cfg.get("model") or {}).get("name"),
        "kv_mode": (cfg.get("kv") or {}).get("mode") or _override(status, "kv") or _override(status, "kv.mode"),
        "memory_budget": (cfg.get("memory") or {}).get("budget"), "job": (cfg.get("job") or {}).get("name"),
        "config_hash": status.get("config_hash"), "compare_key": status.get("compare_key"),
        "wall_s": status.get("wall_s"), "pid": status.get("pid"), "model_loads": status.get("model_loads"),
        "results": None, "kv_config": cfg.get("kv") or {},
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
                   spec_acceptance=s.get("spec_acceptance"),
                   decode_tokens_per_s=eng.get("decode_tokens_per_s"),
                   peak_memory_bytes=s.get("peak_memory_bytes"), kv_bytes_per_token=eng.get("kv_bytes_per_token"),
                   route=s.get("route"), model=s.get("model") or rec["model"],
                   kv_mode=s.get("kv_mode") or rec["kv_mode"], kv_label=eng.get("kv_label"))
        rec.update({f"rows_{c}": int(by_code.get(c, 0)) for c in ERROR_CODES})
        rec.update(kv_capacity(eng))
        if rec.get("kv_tokens_fit") is not None and rec["results"]:
            rec["kv_rows_fit"] = _rows_fit(rec["results"], rec["kv_tokens_fit"])
    return rec


def _rows_fit(results: str, tokens_fit: int) -> Optional[int]:
    """Rows of this job's mean length (prompt + output, finished rows) that the KV budget holds at once."""
    import pyarrow.parquet as pq

    t = pq.read_table(results, columns=["prompt_tokens", "output_tokens", "error_code"]).to_pylist()
    lens = [(r["prompt_tokens"] or 0) + (r["output_tokens"] or 0) for r in t if r["error_code"] is None]
    return int(tokens_fit * len(lens) // sum(lens)) if lens and sum(lens) else None


def kv_capacity(eng: dict) -> dict:
    """The KV cache's own bytes, which a job's peak memory hides when the weights dominate: its peak
    (pages in use at the peak x page bytes), the budget left for it next to the weights, and the
    tokens of context that budget holds (rows x context; before workspace, so an upper bound)."""
    per_token, page = eng.get("kv_bytes_per_token"), eng.get("page_size")
    budget, weights = eng.get("budget_bytes"), eng.get("weights_bytes")
    out: dict = {}
    if per_token and page and eng.get("peak_pages_in_use") is not None:
        out["kv_peak_bytes"] = int(eng["peak_pages_in_use"]) * int(page) * int(per_token)
    if per_token and budget and weights is not None:
        out["kv_budget_bytes"] = max(int(budget) - int(weights), 0)
        out["kv_tokens_fit"] = out["kv_budget_bytes"] // int(per_token)
    return out


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


LAYOUT_KEYS = ("group_size", "page_size")  # kv settings a mode's label does not name


def add_kv_labels(records: list[dict]) -> None:
    """kv_label: the KV mode as the engine names it (summary.json's kv_label, else kv.mode), plus the
    layout settings that differ between the sweep's jobs (q8 group_size=32): one plotted point per label."""
    varying = [k for k in LAYOUT_KEYS if len({(r.get("kv_config") or {}).get(k) for r in records
                                              if r.get("kv_config")}) > 1]
    for r in records:
        base = r.get("kv_label") or r.get("kv_mode")
        if base is None:
            continue
        kv = r.get("kv_config") or {}
        r["kv_label"] = " ".join([base, *[f"{k}={kv[k]}" for k in varying if k in kv]])


def to_table(records: list[dict], metadata: dict[str, str]) -> pa.Table:
    """The sweep records as an Arrow table in the sweep.parquet schema, with `metadata` on the schema."""
    rows = [{c: r.get(c) for c in SCHEMA.names} for r in records]
    t = pa.Table.from_pylist(rows, schema=SCHEMA)
    return t.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
