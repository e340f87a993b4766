"""job_status.json: how one sweep job started and ended; how its outcome reaches the report
(with the joblib launcher a job runs in another process)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

STATUS_FILE = "job_status.json"


def write_status(job_dir: Path, status: dict) -> None:
    """job_status.json, atomically (a reader never sees half a file)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".{STATUS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(status, indent=1, default=str))
    os.replace(tmp, job_dir / STATUS_FILE)


def read_status(job_dir: Path) -> Optional[dict]:
    """A sweep job's job_status.json, or None when it is missing or unreadable."""
    try:
        return json.loads((job_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
