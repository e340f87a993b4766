"""Teacher-forced quality of each quantized sweep job against its kv=none partner.

The partner's outputs (same model, prompts and sampling: compare.py found it) are scored under the
quantized job's cache and under the partner's own (engine/scoring.py): per row KL(none || mode) mean
and max, top-1 agreement and the text's log-likelihood, written to the job's teacher_forced.parquet;
per job the columns tf_* of sweep.parquet. A job's scores are reused while its teacher_forced.parquet
names the same two configs (action=report does not score again). Nothing here lists KV modes: a job is
scored with the engine its own resolved config builds, whatever its kv section holds.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

TF_FILE = "teacher_forced.parquet"
REFERENCE_BYTES = 512 << 20  # the kept kv=none log-probabilities of one group of rows (engine/scoring.py)
ROW_SCHEMA = pa.schema([("row_key", pa.string()), ("positions", pa.int64()), ("kl_mean", pa.float64()),
                        ("kl_max", pa.float64()), ("top1_agreement", pa.float64()), ("nll", pa.float64()),
                        ("nll_baseline", pa.float64()), ("error_code", pa.string())])


def _config(job_dir: str):
    """The job's resolved config (job_status.json) as the typed Config."""
    from omegaconf import OmegaConf

    from kvbatch.pipeline.config import Config, to_config
    from kvbatch.pipeline.sweep.status import read_status

    st = read_status(Path(job_dir)) or {}
    if not st.get("config"):
        raise ValueError(f"{job_dir}: job_status.json has no resolved config")
    return to_config(OmegaConf.merge(OmegaConf.structured(Config), st["config"]))


def _rows(cfg, tokenizer, results: str):
    """The partner's finished rows as ForcedRows: prompts encoded again from the job's input, as its
    worker encoded them (a row whose prompt now encodes to another length than it ran with is skipped)."""
    from kvbatch.engine.scoring import ForcedRow
    from kvbatch.pipeline.inputs import read_rows, resolve_input
    from kvbatch.pipeline.prompts import encode
    from kvbatch.pipeline.samples import expand

    t = pq.read_table(results, columns=["row_key", "output_token_ids", "error_code", "prompt_tokens"]).to_pylist()
    ran = {r["row_key"]: r for r in t if r["error_code"] is None and r["output_token_ids"]}
    payloads = {r.key: r.payload for r in expand(read_rows(resolve_input(cfg.job.input), cfg.job.format, cfg.job),
                                                 cfg.sampling.n)}
    out = []
    for key, r in ran.items():
        p = payloads.get(key)
        if p is None or "error" in p:
            continue
        ids = encode(tokenizer, p, cfg.job)
        if len(ids) == r["prompt_tokens"]:
            out.append(ForcedRow(key, ids, list(r["output_token_ids"])))
    return out


def _cached(job_dir: str, base_hash: Optional[str], own_hash: Optional[str]) -> Optional[list[dict]]:
    path = Path(job_dir) / TF_FILE
    if not path.exists():
        return None
    try:
        t = pq.read_table(path)
    except Exception:  # noqa: BLE001 - unreadable: score again
        return None
    meta = {k.decode(): v.decode() for k, v in (t.schema.metadata or {}).items()}
    if meta.get("baseline_config_hash") != str(base_hash) or meta.get("config_hash") != str(own_hash):
        return None
    return t.to_pylist()


def _write(job_dir: str, rows: list[dict], base: dict, own_hash: Optional[str]) -> None:
    from kvbatch.pipeline.parts import write_atomic

    meta = {"baseline_job_dir": str(base["job_dir"]), "baseline_config_hash": str(base.get("config_hash")),
            "config_hash": str(own_hash)}
    t = pa.Table.from_pylist(rows, schema=ROW_SCHEMA).replace_schema_metadata(
        {k.encode(): v.encode() for k, v in meta.items()})
    write_atomic(t, Path(job_dir) / TF_FILE)


def _score(base: dict, jobs: list[dict]) -> dict[str, list[dict]]:
    """Score the partner's rows under each job's cache: job_dir -> rows of ROW_SCHEMA."""
    from kvbatch.engine import Engine
    from kvbatch.engine.scoring import compare
    from kvbatch.pipeline import model_cache
    from kvbatch.pipeline.config import engine_config

    bcfg = _config(base["job_dir"])
    model, tokenizer, spec = model_cache.load_model(bcfg.model)
    rows = _rows(bcfg, tokenizer, base["results"])
    ref = Engine(model, tokenizer, spec, engine_config(bcfg))
    engines = {j["job_dir"]: Engine(model, tokenizer, spec, engine_config(_config(j["job_dir"]))) for j in jobs}
    try:
        scored = compare(ref, engines, rows, REFERENCE_BYTES)
    finally:
        del ref, engines
        model_cache.release()
    return {d: [{"row_key": q.key, "positions": q.positions, "kl_mean": q.kl_mean, "kl_max": q.kl_max,
                 "top1_agreement": q.top1_agreement, "nll": q.nll, "nll_baseline": q.nll_reference,
                 "error_code": q.error_code} for q in by_key.values()] for d, by_key in scored.items()}


def job_summary(rows: list[dict]) -> dict:
    """The tf_* columns of one job from its per-row scores (engine/scoring.py: summarize)."""
    from kvbatch.engine.scoring import RowQuality, summarize

    return summarize([RowQuality(r["row_key"], r["positions"], r["kl_mean"], r["kl_max"], r["top1_agreement"],
                                 r["nll"], r["nll_baseline"], r["error_code"]) for r in rows])


def add_quality(records: list[dict]) -> None:
    """tf_* columns for every completed quantized job with a kv=none partner (add_agreement ran first)."""
    by_dir = {r.get("job_dir"): r for r in records}
    pending: dict[str, list[dict]] = {}
    for r in records:
        base = by_dir.get(r.get("baseline_job_dir"))
        if r["status"] != "completed" or base is None or not base.get("results"):
            continue
        rows = _cached(r["job_dir"], base.get("config_hash"), r.get("config_hash"))
        if rows is None:
            pending.setdefault(base["job_dir"], []).append(r)
        else:
            r.update(job_summary(rows))
    for base_dir, jobs in pending.items():
        base = by_dir[base_dir]
        try:
            scored = _score(base, jobs)
        except Exception as exc:  # noqa: BLE001 - the report stands without these columns
            traceback.print_exc()
            for r in jobs:
                r["tf_error"] = f"{type(exc).__name__}: {exc}"
            continue
        for r in jobs:
            _write(r["job_dir"], scored[r["job_dir"]], base, r.get("config_hash"))
            r.update(job_summary(scored[r["job_dir"]]))
