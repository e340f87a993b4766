"""Build a model directory once in the cache dir, atomically, and reuse it afterwards.

A build writes into a temporary sibling directory, writes the completion
marker last, then renames it into place. A directory without the marker (or a
leftover temporary directory) is never taken as whole: it is removed and the
build redone. A file lock serializes concurrent builders (e.g. a Hydra sweep).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

MARKER = ".kvbatch-complete"
TMP_INFIX = ".tmp-"


def cache_root(cache_dir: Optional[str] = None) -> Path:
    """model.cache_dir, else $KVBATCH_CACHE_DIR, else ~/.cache/kvbatch/models."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if env := os.environ.get("KVBATCH_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvbatch" / "models"


def is_complete(target: Path) -> bool:
    """Whether a built model directory has its completion marker (a finished build)."""
    return (target / MARKER).is_file()


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def materialize(target: Path, build: Callable[[Path], object], info: Optional[dict] = None) -> Path:
    """Return `target`, running `build(tmp_dir)` first unless a complete copy exists."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if is_complete(target):  # another process finished it while we waited
            return target
        for leftover in target.parent.glob(f".{target.name}{TMP_INFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)  # from a build that died half-way
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_INFIX}", dir=target.parent))
        try:
            build(tmp)
            marker = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(info or {})}
            (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # written last
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model dir is not
            if target.exists():
                shutil.rmtree(target)  # incomplete: never reused
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
