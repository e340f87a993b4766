"""Composing a config the way the command does, and saying what is wrong with one line.

Shared by the CLI (a plain run is composed and checked before Hydra runs it) and the
sweep (each value of a swept override is composed once before any job runs; each job
checks its own node). Importing this registers the schema in Hydra's ConfigStore.
"""
from __future__ import annotations

from pathlib import Path

from hydra.errors import MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.pipeline import keys
from kvbatch.pipeline.config import Config, register, to_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

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
            return keys.message(Config, str(key))
        if "is not a ListConfig" in first and key:  # a list key given one value: job.stop=END
            value = getattr(err, "value", None)
            shown = value if isinstance(value, str) else "..."
            return f"{key}={shown}: a list; write {key}=[{shown}]"
        return f"{key}: {first}" if key else first
    return " ".join(str(exc).split("\n\n")[0].split("\n")) or type(exc).__name__


def check_keys(node: DictConfig) -> None:
    """`+foo=1`, `+sampling.typical_p=0.9` slip past the schema (OmegaConf would drop them without a word):
    refuse every key, at any depth, that the schema does not have."""
    bad = keys.unknown(Config, node)
    if bad:
        raise KvbatchConfigError(keys.message(Config, bad))


def node_to_config(node: DictConfig) -> Config:
    """A composed node -> a validated Config (raises on unknown keys and bad values)."""
    check_keys(node)
    return to_config(node)


def compose_nodes(override_lists: list[list[str]]) -> list[DictConfig]:
    """Compose the config once per override list (unchecked nodes; Hydra's errors propagate)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="kvbatch"):
        return [compose(config_name="config", overrides=o) for o in override_lists]


def compose_config(overrides: list[str]) -> Config:
    """The composed, validated Config for these overrides (raises on any problem)."""
    return node_to_config(compose_nodes([overrides])[0])
