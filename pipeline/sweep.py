"""Sweeps (`kvbatch -m kv=none,q8,q4 ...`): one job per override combination, then a report.

Each job runs in Hydra's job folder (`<hydra.sweep.dir>/<job num>/`): its queue,
parts, results.parquet and summary.json land there, next to `job_status.json`
(written when the job starts and again, in a `finally`, when it ends: completed,
failed with its reason, or interrupted). A job that fails (a KV mode the gate
refuses, a value the config checks refuse, an unexpected exception) fails alone:
the sweep goes on. With the basic launcher every job runs in this process: the
model is loaded once per distinct model config (pipeline/model_cache.py) and each
job's engines and KV pools are dropped and MLX's buffer cache cleared before the
next one. With `hydra/launcher=joblib` jobs run in worker processes; the status
files are how their outcome reaches the report.

`SweepCallback.on_multirun_end` (registered in conf/config.yaml) reads the job
folders and writes sweep.parquet and report.md (pipeline/sweep_report.py) in the
sweep folder. If the multirun itself dies (a joblib worker killed), `main()` still
builds the report from whatever the job folders hold. The command exits 1 when a
job did not complete, 0 when all did.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kvbatch.pipeline import model_cache

STATUS_FILE = "job_status.json"

# What this process's multirun did (read by pipeline.app.main after Hydra returns).
_state: dict[str, Any] = {"sweep_dir": None, "report": None}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_status(job_dir: Path, status: dict) -> None:
    """job_status.json, atomically (a reader never sees half a file)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".{STATUS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(status, indent=1, default=str))
    os.replace(tmp, job_dir / STATUS_FILE)


def read_status(job_dir: Path) -> Optional[dict]:
    try:
        return json.loads((job_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def compare_key(cfg, input_path: Path) -> str:
    """Jobs with equal keys saw the same model, prompts and sampling (KV, memory, engine may differ)."""
    import hashlib

    from kvbatch.pipeline.config import as_dict

    d = as_dict(cfg)
    keyed = {k: d[k] for k in ("model", "job", "sampling", "debug")}
    keyed["model"].pop("cache_dir", None)
    keyed["job"] = {**keyed["job"], "input": str(input_path), "name": None}
    blob = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _check_reuse(job) -> None:
    """A job folder reused by a later sweep must hold this config's queue, never another's."""
    from kvbatch.pipeline.config import ConfigError
    from kvbatch.pipeline.queue import Queue

    if not job.queue_path.exists():
        return
    q = Queue(job.queue_path)
    try:
        old = q.get_meta("config_hash")
    finally:
        q.close()
    if old and old != job.config_hash:
        raise ConfigError(f"{job.out_dir} holds the queue of another config (hash {old}, this job "
                          f"{job.config_hash}); run the sweep with a new hydra.sweep.dir")


def _reset_peak() -> None:
    try:
        import mlx.core as mx

        mx.reset_peak_memory()  # each job's summary reports its own peak, not an earlier job's
    except Exception:  # noqa: BLE001
        pass


def _active_memory() -> Optional[int]:
    try:
        import mlx.core as mx

        return int(mx.get_active_memory())
    except Exception:  # noqa: BLE001
        return None


def run_sweep_job(node: DictConfig) -> dict:
    """The Hydra task of one multirun job: run it in its job folder, record how it ended, never raise
    (except Ctrl-C, after recording it)."""
    from hydra.core.hydra_config import HydraConfig

    from kvbatch.pipeline import actions
    from kvbatch.pipeline.app import _no_extra_keys, describe
    from kvbatch.pipeline.config import ConfigError, as_dict, to_config
    from kvbatch.engine.errors import KvbatchConfigError
    from omegaconf.errors import OmegaConfBaseException

    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir).resolve()
    overrides = list(hc.overrides.task)
    num = int(hc.job.num)
    label = " ".join(overrides) or "(no overrides)"
    status: dict[str, Any] = {
        "status": "running", "reason": None, "error_type": None, "job_num": num, "job_dir": str(job_dir),
        "sweep_dir": str(Path(hc.sweep.dir).resolve()), "overrides": overrides, "pid": os.getpid(),
        "host": socket.gethostname(), "launcher": str(hc.launcher.get("_target_", "")),
        "started_at": time.time(), "ended_at": None, "wall_s": None, "config": None, "config_hash": None,
        "compare_key": None, "model_loads": 0, "results": None, "summary": None,
        "mlx_active_bytes_at_start": _active_memory(), "mlx_active_bytes_after_release": None,
    }
    write_status(job_dir, status)
    model_cache.enable(True)
    loads0 = model_cache.loads
    _reset_peak()
    t0 = time.perf_counter()
    say(f"kvbatch: sweep job #{num} ({label}) -> {job_dir}")
    try:
        _no_extra_keys(node)
        cfg = to_config(node)
        if cfg.action == "report":
            raise ConfigError("action=report: rebuilds a report from finished sweeps; run it without -m")
        cfg.output.dir = str(job_dir)  # every job of a sweep has its own folder
        status["config"] = as_dict(cfg)
        job = actions.job_for(cfg)
        status.update(config_hash=job.config_hash, compare_key=compare_key(cfg, job.input_path))
        _check_reuse(job)
        path = actions.execute(cfg)
        status.update(status="completed", results=str(path) if path else None)
        if (job_dir / "summary.json").exists():
            status["summary"] = str(job_dir / "summary.json")
    except Exception as exc:  # noqa: BLE001 - the job fails alone; the sweep goes on
        if isinstance(exc, (KvbatchConfigError, OmegaConfBaseException)) or \
                isinstance(exc.__cause__, OmegaConfBaseException):
            reason = describe(exc)
        else:
            reason = f"{type(exc).__name__}: {exc}"
            status["traceback"] = traceback.format_exc()
            traceback.print_exc()
        status.update(status="failed", reason=reason, error_type=type(exc).__name__)
        say(f"kvbatch: sweep job #{num} ({label}) failed: {reason}")
    except BaseException as exc:  # Ctrl-C / SystemExit: record, then let it stop the sweep
        status.update(status="interrupted", reason=f"{type(exc).__name__}", error_type=type(exc).__name__)
        raise
    finally:
        model_cache.release()  # this job's engines and KV pool are gone: give their memory back
        status.update(ended_at=time.time(), wall_s=time.perf_counter() - t0,
                      model_loads=model_cache.loads - loads0, mlx_active_bytes_after_release=_active_memory())
        write_status(job_dir, status)
    return status


# ---- before the multirun -------------------------------------------------------------------------
def check_sweep(args: list[str]) -> None:
    """Compose every value of every swept override once (next to the fixed overrides), so an option or
    key that does not exist (`kv=q3`, `job.max_tokenz=5`) stops the sweep before any job runs, with one
    line, instead of Hydra's report. Values the config checks refuse (`job.max_tokens=-1`) and KV modes
    the gate refuses are left to their own jobs: they fail alone. Raises on the first problem."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvbatch.pipeline.app import CONF_DIR, _no_extra_keys

    fixed: list[str] = []
    swept: list[list[str]] = []
    for o in OverridesParser.create().parse_overrides(args):
        key = o.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue  # Hydra checks its own settings (launcher, sweep dir) itself
        if o.is_sweep_override():
            if o.is_discrete_sweep():
                swept.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            fixed.append(o.input_line)
    combos = [[v] for values in swept for v in values] or [[]]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="kvbatch"):
        for extra in combos:
            _no_extra_keys(compose(config_name="config", overrides=fixed + extra))


# ---- end of the multirun ------------------------------------------------------------------------
def build_report(sweep_dir: Path) -> Optional[dict]:
    """sweep.parquet + report.md in the sweep folder; prints where they are. None if it failed."""
    from kvbatch.pipeline.sweep_report import write_report

    try:
        res = write_report([sweep_dir], sweep_dir)
    except Exception as exc:  # noqa: BLE001 - the jobs' results stand even if the report cannot be built
        traceback.print_exc()
        say(f"kvbatch: the sweep report could not be written: {type(exc).__name__}: {exc}")
        res = {"error": str(exc), "failed": 1}
        _state["report"] = res
        return None
    _state["report"] = res
    print(res["line"])
    print(res["parquet"])
    return res


class SweepCallback(Callback):
    """Writes the sweep report at the end of every multirun (both launchers: it runs in the main process)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _state.update(sweep_dir=Path(str(config.hydra.sweep.dir)).resolve(), report=None)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        build_report(Path(str(config.hydra.sweep.dir)).resolve())


def after_hydra(crashed: bool = False) -> int:
    """Called by main() once Hydra returns: 0 unless this process ran a sweep in which a job did not
    complete (or whose report failed). After a crash of the multirun itself, build the report from
    the job folders first, so finished jobs are not lost from it."""
    sweep_dir = _state.get("sweep_dir")
    if sweep_dir is None:
        return 0
    if _state.get("report") is None and crashed:
        if not any(Path(sweep_dir).rglob(STATUS_FILE)):
            return 0  # no job started: Hydra's error is the whole story
        say("kvbatch: the sweep stopped early; writing the report from the job folders")
        build_report(sweep_dir)
    res = _state.get("report") or {}
    return 1 if (res.get("failed") or res.get("error")) else 0
