"""One sweep job (the Hydra task of a multirun), and the check that runs before any job.

A job runs in Hydra's job folder and never raises (except Ctrl-C, after recording it):
job_status.json says how it ended, and the sweep goes on.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.pipeline import actions, model_cache
from kvbatch.pipeline.compose import check_keys, compose_nodes, describe, node_to_config
from kvbatch.pipeline.config import ConfigError, as_stored, compare_key
from kvbatch.pipeline.redact import redact_override
from kvbatch.pipeline.queue import Queue
from kvbatch.pipeline.sweep.status import write_status


def say(msg: str) -> None:
    """Print a message on stderr at once."""
    print(msg, file=sys.stderr, flush=True)


def _check_reuse(job) -> None:
    """A job folder reused by a later sweep must hold this config's queue, never another's."""
    if job.cfg.queue.url or not job.queue_path.exists():  # a database's jobs are keyed by their config
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

    from kvbatch.pipeline.log import configure_command

    configure_command()  # a launcher's worker process is the command's too: its job's lines as the command's
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir).resolve()
    overrides = [redact_override(o) for o in hc.overrides.task]  # never a password in a sweep's files
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
        cfg = node_to_config(node)
        if cfg.action == "report":
            raise ConfigError("action=report: rebuilds a report from finished sweeps; run it without -m")
        if cfg.action != "work" and not cfg.queue.shards:
            cfg.output.dir = str(job_dir)  # every job of a sweep has its own folder ...
        # ... except workers (action=work, worker.replica=range(N) on a launcher): they share the job's queue,
        # and the shards of a sharded job (queue.shards=N, worker.shard=range(N)): they share its folder
        status["config"] = as_stored(cfg)
        job = actions.job_for(cfg)
        status.update(config_hash=job.config_hash, compare_key=compare_key(cfg, str(job.input_path)))
        _check_reuse(job)
        path = actions.execute(cfg)
        status.update(status="completed", results=str(path) if path else None)
        if (job_dir / "summary.json").exists():
            status["summary"] = str(job_dir / "summary.json")
    except Exception as exc:  # noqa: BLE001 - the job fails alone; the sweep goes on
        if isinstance(exc, (KvbatchConfigError, OmegaConfBaseException, actions.RowsFailed)) or \
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
def parse_sweep(args: list[str]) -> list[tuple[Any, Optional[list[str]]]]:
    """Hydra's parsed overrides with the values of each discrete sweep (None for the others). A glob(...)
    sweep lists a group's options through the config loader of kvbatch's config tree, as Hydra's own
    sweeper does (without one it fails with "ConfigLoader is not set")."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from kvbatch.pipeline.compose import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="kvbatch"):
        loader = GlobalHydra.instance().config_loader()
        return [(o, list(o.sweep_string_iterator()) if o.is_sweep_override() and o.is_discrete_sweep() else None)
                for o in OverridesParser.create(config_loader=loader).parse_overrides(args)]


def check_sweep(args: list[str]) -> None:
    """Compose every value of every swept override once (next to the fixed overrides), so an option or
    key that does not exist (`kv=q3`, `job.max_tokenz=5`) stops the sweep before any job runs, with one
    line, instead of Hydra's report. Values the config checks refuse (`job.max_tokens=-1`) and KV modes
    the gate refuses are left to their own jobs: they fail alone. Raises on the first problem."""
    fixed: list[str] = []
    swept: list[list[str]] = []
    for o, values in parse_sweep(args):
        key = o.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue  # Hydra checks its own settings (launcher, sweep dir) itself
        if o.is_sweep_override():
            if o.is_discrete_sweep():
                assert values is not None  # parse_sweep lists a discrete sweep's values
                swept.append([f"{key}={v}" for v in values])
        else:
            fixed.append(o.input_line)
    combos = [[v] for values in swept for v in values] or [[]]
    for node in compose_nodes([fixed + extra for extra in combos]):
        check_keys(node)
