"""Find a job's output folders from its name alone, for the actions that only read or fix a folder
(status, finalize, retry).

A run's folder is <output.root>/<job.name>/<config hash>: the hash covers the options that shape
the results, so `action=status` with one option left out computes another hash, whose folder
does not exist while the job runs. These actions look for the exact folder first, then
for every folder of the job's name: one is used (said on stderr), several are listed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, cast

from omegaconf import OmegaConf

from kvbatch.pipeline.config import Config, ConfigError
from kvbatch.pipeline.queue import Queue

QUEUE = "queue.sqlite"


@dataclass
class Folder:
    """One output folder of a job: its config hash, input and config, as the read-only actions list it."""

    path: Path
    config_hash: Optional[str]
    input: Optional[str]
    cfg: Optional[Config]  # the folder's own config.yaml (None when it cannot be read)

    def describe(self) -> str:
        """One short line: where, with what, how far."""
        q = Queue(self.path / QUEUE)
        try:
            c = q.counts()
        finally:
            q.close()
        what = f"model={self.cfg.model.name} kv={self.cfg.kv.mode}" if self.cfg else "config unknown"
        age = time.time() - (self.path / QUEUE).stat().st_mtime
        return (f"{self.path} ({what}; {sum(c.values())} rows: {c['done']} done, {c['error']} error, "
                f"{c['pending'] + c['leased']} to do; changed {age / 60:.0f} min ago)")


def folder_config(path: Path) -> Optional[Config]:
    """The config a folder was made with (its config.yaml), or None when it does not fit this schema."""
    try:
        node = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path / "config.yaml"))
        return cast(Config, OmegaConf.to_object(node))  # a structured Config node: a Config
    except Exception:  # noqa: BLE001 - an older or edited file: the folder is still listed
        return None


def open_folder(path: Path) -> Folder:
    """Read a job folder's queue metadata and config.yaml."""
    q = Queue(path / QUEUE)
    try:
        return Folder(path, q.get_meta("config_hash"), q.get_meta("input"), folder_config(path))
    finally:
        q.close()


def job_folders(cfg: Config) -> list[Path]:
    """Every folder under <output.root>/<job.name>/ that holds a queue, newest first."""
    base = Path(cfg.output.root) / cfg.job.name
    found = [p.parent.resolve() for p in base.glob(f"*/{QUEUE}")] if base.is_dir() else []
    return sorted(found, key=lambda p: (p / QUEUE).stat().st_mtime, reverse=True)


def locate(cfg: Config, exact: Path, action: str) -> tuple[list[Folder], Optional[str]]:
    """The folders `action` should use, and a note for stderr (None when the exact folder exists).

    `exact`: the folder these options name (output.dir, or root/name/hash). Returns [] when the job
    has no folder at all. Raises ConfigError for finalize/retry when the job has several folders."""
    if cfg.output.dir or (exact / QUEUE).exists():
        return ([open_folder(exact)] if (exact / QUEUE).exists() else []), None
    paths = job_folders(cfg)
    if not paths:
        return [], None
    folders = [open_folder(p) for p in paths]
    if len(folders) == 1:
        return folders, (f"kvbatch: no folder for exactly these options; using the only folder of job "
                         f"{cfg.job.name!r}, {paths[0]}")
    if action != "status":
        raise ConfigError(f"action={action}: job {cfg.job.name!r} has {len(folders)} folders under "
                          f"{paths[0].parent}; choose one with output.dir=FOLDER and the options it was made with "
                          f"(its config.yaml), or pass those options alone: "
                          + "; ".join(f.describe() for f in folders))
    return folders, (f"kvbatch: no folder for exactly these options; job {cfg.job.name!r} has {len(folders)} "
                     f"folders (newest first; output.dir=... picks one):")
