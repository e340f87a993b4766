"""The `kvbatch` command (also `python -m kvbatch`): Hydra composes the config, actions run it.

A single run is composed and validated first with Hydra's compose API, so any bad
key or value is reported as one line on stderr (exit 2) instead of Hydra's
multi-line report; then the Hydra app runs it (multirun, --cfg, --help keep working).
"""
from __future__ import annotations

import sys
from pathlib import Path

import kvbatch.engine  # noqa: F401  (loads OpenBLAS before anything imports mlx)
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.pipeline.config import register, to_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# Flags that make Hydra do something other than one plain run: leave those to Hydra.
_HYDRA_FLAGS = ("-m", "--multirun", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i",
                "--resolve", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                "--config-dir", "-cd", "--shell-completion", "-sc", "--run", "-r")

register()


def describe(exc: BaseException) -> str:
    """One line naming the bad key, from Hydra/OmegaConf's multi-line reports."""
    if isinstance(exc, KvbatchConfigError):
        return str(exc)
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        opts = f" (choose one of: {', '.join(exc.options)})" if exc.options else ""
        return f"{group}={name}: no such option{opts}" if group else exc.missing_cfg_file + ": not found"
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, OmegaConfBaseException) or isinstance(cause, OmegaConfBaseException):
        err = exc if isinstance(exc, OmegaConfBaseException) else cause
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        key = getattr(err, "full_key", None)
        if "not in" in first and key:
            return f"{key}: unknown key (check the spelling; `kvbatch --cfg job` shows every key)"
        return f"{key}: {first}" if key else first
    return " ".join(str(exc).split("\n\n")[0].split("\n")) or type(exc).__name__


def die(msg: str, code: int = 2) -> None:
    print(f"kvbatch: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def compose_config(overrides: list[str]):
    """The composed, validated Config for these overrides (raises on any problem)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="kvbatch"):
        node = compose(config_name="config", overrides=overrides)
    _no_extra_keys(node)
    return to_config(node)


def _no_extra_keys(node: DictConfig) -> None:
    """`+foo=1` slips past the schema at the top level; refuse keys the schema does not have."""
    from kvbatch.pipeline.config import Config

    extra = [k for k in node.keys() if k not in Config.__dataclass_fields__ and k != "hydra"]
    if extra:
        raise KvbatchConfigError(f"{extra[0]}: unknown key (not part of kvbatch's config)")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_app(node: DictConfig):
    from kvbatch.pipeline.actions import execute

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        from kvbatch.pipeline.sweep import run_sweep_job

        return run_sweep_job(node)  # one job of a sweep: fails alone, recorded in its job folder
    try:
        _no_extra_keys(node)
        cfg = to_config(node)
        if cfg.action == "report":
            from kvbatch.pipeline.sweep_report import report_action

            report_action(cfg)
        else:
            execute(cfg)
    except (KvbatchConfigError, OmegaConfBaseException) as exc:
        die(describe(exc))


def main() -> None:
    args = sys.argv[1:]
    if not any(a.split("=")[0] in _HYDRA_FLAGS for a in args):
        try:
            compose_config(args)
        except Exception as exc:  # noqa: BLE001 - every composition problem becomes one line
            die(describe(exc))
    elif {a.split("=")[0] for a in args if a.startswith("-")} <= {"-m", "--multirun"}:
        from kvbatch.pipeline.sweep import check_sweep

        try:  # an option or key that does not exist stops the sweep before any job, with one line
            check_sweep([a for a in args if a not in ("-m", "--multirun")])
        except Exception as exc:  # noqa: BLE001
            die(describe(exc))
    from kvbatch.pipeline.sweep import after_hydra

    try:
        _hydra_app()
    except (SystemExit, KeyboardInterrupt):
        after_hydra(crashed=True)  # a multirun that died (or was stopped) still gets its report
        raise
    code = after_hydra()  # 1 when a sweep job did not complete
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
