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
from kvbatch.pipeline import extras
from kvbatch.pipeline.log import configure_command, unconfigure_command
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
    """The `kvbatch` command: --version, else a Hydra run or multirun of the config and its overrides.
    Messages for people go to stderr, the summary and the results path (the last line) to stdout
    (pipeline/log.py); the library's logging is configured for this command only."""
    configure_command()
    try:
        _main(sys.argv[1:])
    finally:
        unconfigure_command()


def _paths_as_options(args: list[str]) -> list[str]:
    """What the API accepts, the command too: `model=REPO_ID` or `model=FOLDER` (model=local with that
    model.path), and `job=DIR/job/NAME.yaml` (Hydra's `--config-dir DIR job=NAME`)."""
    out, flags = [], []  # Hydra's flags come before the overrides
    for a in args:
        key, _, value = a.partition("=")
        if key == "model" and value and not (CONF_DIR / "model" / f"{value}.yaml").exists() \
                and ("/" in value or Path(value).expanduser().is_dir()):
            out += ["model=local", f"model.path={value}"]
        elif key.lstrip("+") in ("hydra.run.dir", "hydra.output_subdir"):
            die(f"{key}: kvbatch names its own output folders and Hydra writes nothing; set output.dir (or "
                f"output.root)")
        elif key == "job" and value.endswith((".yaml", ".yml")):
            path = Path(value).expanduser().resolve()
            if not path.is_file() or path.parent.name != "job":
                die(f"job={value}: a job file outside jobs/ is chosen by name from a folder of its own: put it "
                    f"at DIR/job/{path.stem}.yaml and run `kvbatch --config-dir DIR job={path.stem}` "
                    f"(Hydra's -cd), or copy it to jobs/{path.name} and run `kvbatch job={path.stem}`")
            flags += ["--config-dir", str(path.parent.parent)]
            out.append(f"job={path.stem}")
        else:
            out.append(a)
    return flags + out


def _main(args: list[str]) -> None:
    args = _paths_as_options(move_password_to_env(args, os.environ))  # Hydra never sees a password (pipeline/redact.py)
    sys.argv = [sys.argv[0], *args]  # Hydra reads the command line from sys.argv
    if "--version" in args or "-V" in args:  # Hydra has no such flag (it would try to parse it as an override)
        print(version_line())
        return
    multirun = any(a in _MULTIRUN for a in args)
    if multirun and extras.missing("sweep"):
        die(str(extras.missing("sweep")))
    for a in args:  # a launcher kvbatch[slurm] installs: one line instead of Hydra's "no such option"
        if a.partition("=")[0] == "hydra/launcher" and extras.missing_launcher(a.partition("=")[2]):
            die(str(extras.missing_launcher(a.partition("=")[2])))
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
