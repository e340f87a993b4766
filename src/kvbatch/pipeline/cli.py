"""The `kvbatch` command (also `python -m kvbatch`): Hydra composes the config, actions run it.

A single run is composed and validated first with Hydra's compose API, so any bad
key or value is reported as one line on stderr (exit 2) instead of Hydra's
multi-line report; then the Hydra app runs it (multirun, --cfg, --help keep working).
The entry point only: nothing imports this module (composition lives in compose.py).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import kvbatch.engine  # noqa: F401  (loads OpenBLAS before anything imports mlx)
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.pipeline.compose import CONF_DIR, compose_config, describe, node_to_config
from kvbatch.pipeline.redact import move_password_to_env

# Flags that make Hydra do something other than one plain run: leave those to Hydra.
_HYDRA_FLAGS = ("-m", "--multirun", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i",
                "--resolve", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--shell-completion", "-sc", "--run", "-r")
_MULTIRUN = ("-m", "--multirun")


def die(msg: str, code: int = 2) -> None:
    """Print `kvbatch: error: msg` on stderr and exit with `code`."""
    print(f"kvbatch: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_app(node: DictConfig):
    from kvbatch.pipeline.actions import RowsFailed, execute

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from kvbatch.pipeline.sweep.run import run_sweep_job

        return run_sweep_job(node)  # one job of a sweep: fails alone, recorded in its job folder
    try:
        cfg = node_to_config(node)
        if cfg.action == "report":
            from kvbatch.pipeline.sweep.report.write import report_action

            report_action(cfg)
        else:
            execute(cfg)
    except (KvbatchConfigError, OmegaConfBaseException) as exc:
        die(describe(exc))
    except RowsFailed as exc:  # the results are written; exit 1 so cron/systemd notice
        die(str(exc), 1)


def version_line() -> str:
    """The `kvbatch --version` line: kvbatch, mlx, mlx-lm and Python versions."""
    from kvbatch.pipeline.summary import versions

    v = versions()
    return f"kvbatch {v['kvbatch']} (mlx {v['mlx']}, mlx-lm {v['mlx-lm']}, Python {sys.version.split()[0]})"


def main() -> None:
    """The `kvbatch` command: --version, else a Hydra run or multirun of the config and its overrides."""
    args = move_password_to_env(sys.argv[1:], os.environ)  # Hydra never sees a password (pipeline/redact.py)
    sys.argv = [sys.argv[0], *args]
    if "--version" in args or "-V" in args:  # Hydra has no such flag (it would try to parse it as an override)
        print(version_line())
        return
    multirun = any(a in _MULTIRUN for a in args)
    if not any(a.split("=")[0] in _HYDRA_FLAGS for a in args):
        try:
            compose_config(args)
        except Exception as exc:  # noqa: BLE001 - every composition problem becomes one line
            die(describe(exc))
    elif multirun and {a.split("=")[0] for a in args if a.startswith("-")} <= set(_MULTIRUN):
        from kvbatch.pipeline.sweep.run import check_sweep

        try:  # an option or key that does not exist stops the sweep before any job, with one line
            check_sweep([a for a in args if a not in _MULTIRUN])
        except Exception as exc:  # noqa: BLE001
            die(describe(exc))
    if not multirun:
        _hydra_app()
        return
    from kvbatch.pipeline.sweep.callback import OUTCOME_KEY, after_sweep

    # The sweep callback (it runs in this process, inside Hydra) records the sweep folder and
    # the report's result in this file; Hydra's own return value does not reach us.
    fd, outcome = tempfile.mkstemp(prefix="kvbatch-sweep-", suffix=".json")
    os.close(fd)
    sys.argv = [sys.argv[0], *args, f"{OUTCOME_KEY}={outcome}"]
    try:
        try:
            _hydra_app()
        except (SystemExit, KeyboardInterrupt):
            after_sweep(Path(outcome), crashed=True)  # a multirun that died (or was stopped) still gets its report
            raise
        code = after_sweep(Path(outcome))  # 1 when a sweep job did not complete
    finally:
        Path(outcome).unlink(missing_ok=True)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
