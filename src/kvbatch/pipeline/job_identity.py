"""A job's identity (`<job.name>/<config hash>`) and the output folder that belongs to it.

An output folder belongs to one job: `enqueue` records the identity in the folder (FILE) and in the
queue's metadata (META); every part a worker writes carries it in its Parquet metadata (PART_KEY), and
reconcile and finalize take only the parts of their own job. A second identity in a folder (output.dir
reused with other settings, on either store) is refused in one line, so rows made under another
config never come back as this one's. A part without an identity (written by a kvbatch before parts
carried one) belongs to the folder's job.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from kvbatch.pipeline.config import ConfigError

FILE = ".kvbatch-job"
META = "job_id"
PART_KEY = "kvbatch.part.job"


def of(name: str, config_hash: str) -> str:
    """The identity of a job: its name and config hash."""
    return f"{name}/{config_hash}"


def held(out_dir: Path) -> Optional[str]:
    """The identity the folder belongs to (None: none recorded yet)."""
    try:
        return (Path(out_dir) / FILE).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def claim(out_dir: Path, identity: str) -> None:
    """Record that the folder belongs to `identity`; ConfigError when it belongs to another job."""
    have = held(out_dir)
    if have is not None and have != identity:
        raise ConfigError(f"output.dir={str(out_dir)!r} holds the rows of another config (job {have}; this config is "
                          f"job {identity}): "
                          f"a changed model, job, sampling or KV setting is another job, whose rows must not mix "
                          f"with these; use a new output.dir (or leave it unset), or delete that folder to start over")
    if have is None:
        path = Path(out_dir) / FILE
        tmp = path.with_name(f"{FILE}.{os.getpid()}.tmp")
        tmp.write_text(identity + "\n", encoding="utf-8")
        os.replace(tmp, path)


def of_part(metadata: Optional[dict]) -> Optional[str]:
    """The identity a part's Parquet metadata names (None: a part written before parts carried one)."""
    raw = (metadata or {}).get(PART_KEY.encode())
    return raw.decode("utf-8", "replace") if raw is not None else None


def owns(identity: Optional[str], metadata: Optional[dict]) -> bool:
    """Whether a part (its Parquet metadata) belongs to the job `identity` (None: any part does)."""
    part = of_part(metadata)
    return identity is None or part is None or part == identity
