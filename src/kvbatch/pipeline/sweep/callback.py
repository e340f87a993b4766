"""The end of a multirun: the sweep report, and the command's exit code.

No module state carries the outcome: the CLI creates an outcome file and hands its path
to the callback as a Hydra setting (`hydra.callbacks.sweep_report.outcome=PATH`, see
OUTCOME_KEY). The callback (Hydra builds it, in the CLI's process, for both launchers)
writes the sweep folder into that file when the multirun starts and the report's result
when it ends; the CLI reads the file once Hydra returns (`after_sweep`). Without the
setting (Hydra run some other way) the report is still written, only no exit code
comes of it.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from kvbatch.pipeline.redact import redact_text
from kvbatch.pipeline.sweep.status import STATUS_FILE

OUTCOME_KEY = "hydra.callbacks.sweep_report.outcome"


def say(msg: str) -> None:
    """Print a message on stderr at once."""
    print(msg, file=sys.stderr, flush=True)


def build_report(sweep_dir: Path, teacher_forced: bool = True) -> dict:
    """sweep.parquet + report.md in the sweep folder; prints where they are. Returns what the
    exit code needs: {"jobs", "completed", "failed"} or {"error", "failed": 1}."""
    from kvbatch.pipeline.sweep.report.write import write_report

    try:
        res = write_report([sweep_dir], sweep_dir, teacher_forced)
    except Exception as exc:  # noqa: BLE001 - the jobs' results stand even if the report cannot be built
        traceback.print_exc()
        say(f"kvbatch: the sweep report could not be written: {type(exc).__name__}: {exc}")
        return {"error": str(exc), "failed": 1}
    print(res["line"])
    print(res["parquet"])
    return {k: res[k] for k in ("jobs", "completed", "failed")}


def workers_outcome(sweep_dir: Path) -> dict:
    """A multirun of workers (action=work, worker.replica=range(N); or the shards of queue.shards=N,
    worker.shard=range(N)): no report to compare (they all ran
    the one job, its results are in the job's own folder); how many completed, for the exit code."""
    from kvbatch.pipeline.sweep.status import read_status

    found = [read_status(p.parent) or {} for p in sorted(sweep_dir.rglob(STATUS_FILE))]
    done = sum(1 for st in found if st.get("status") == "completed")
    say(f"kvbatch: {len(found)} workers: {done} completed" + (f", {len(found) - done} failed (their logs are "
        f"in {sweep_dir})" if done < len(found) else "") + "; the last to end wrote the job's results.parquet")
    return {"jobs": len(found), "completed": done, "failed": len(found) - done}


def scrub(path: Path) -> None:
    """Rewrite a file Hydra wrote with every database URL's password hidden (a URL in a YAML config file)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return
    clean = redact_text(text)
    if clean != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(clean)
        os.replace(tmp, path)


def _write(path: Path, outcome: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(outcome, default=str))
    os.replace(tmp, path)


def read_outcome(path: Path) -> dict:
    """The outcome file the callback wrote ({} when it is missing or unreadable)."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


class SweepCallback(Callback):
    """Writes the sweep report at the end of every multirun (it runs in the main process)."""

    def __init__(self, outcome: Optional[str] = None) -> None:
        self.outcome = Path(outcome) if outcome else None

    def _record(self, **outcome: Any) -> None:
        if self.outcome is not None:
            _write(self.outcome, outcome)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Record the sweep folder before any job runs."""
        self._record(sweep_dir=str(Path(str(config.hydra.sweep.dir)).resolve()), report=None)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Hydra wrote multirun.yaml before the first job: no database password stays in it."""
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            scrub(Path(str(config.hydra.sweep.dir)).resolve() / "multirun.yaml")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write the sweep report (or, for a sweep of workers, their outcome) and record it."""
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        scrub(sweep_dir / "multirun.yaml")
        workers = config.get("action") == "work" or bool(config.get("queue", {}).get("shards"))
        tf = bool(config.get("report", {}).get("teacher_forced", True))
        report = workers_outcome(sweep_dir) if workers else build_report(sweep_dir, tf)
        self._record(sweep_dir=str(sweep_dir), report=report)


def after_sweep(outcome_path: Path, crashed: bool = False) -> int:
    """The exit code once Hydra returns: 1 when a job of the sweep did not complete (or its report
    failed), else 0. After a crash of the multirun itself, build the report from the job folders
    first, so finished jobs are not lost from it."""
    outcome = read_outcome(outcome_path)
    if not outcome.get("sweep_dir"):
        return 0  # the multirun never started: Hydra's error is the whole story
    sweep_dir = Path(outcome["sweep_dir"])
    report = outcome.get("report")
    if report is None and crashed:
        if not any(sweep_dir.rglob(STATUS_FILE)):
            return 0  # no job started: Hydra's error is the whole story
        say("kvbatch: the sweep stopped early; writing the report from the job folders")
        report = build_report(sweep_dir)
    report = report or {}
    return 1 if (report.get("failed") or report.get("error")) else 0
