"""Where a relative path from a job points: the working directory first, then the project root
(where the shipped jobs/ live). One rule for the job's input and for a response_format schema file."""
from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def resolve(path: str) -> Path:
    """Raises OSError or RuntimeError (a symlink loop, an unreadable parent)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    alt = PROJECT_ROOT / p
    return alt.resolve() if alt.exists() else p.resolve()
