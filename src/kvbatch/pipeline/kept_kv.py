"""Where a worker keeps its rows' K/V pages at a stop: one safetensors file per row in the output folder's
`kv/`, named by a hash of the row key (engine/kv/offload.py writes and verifies them).

A stopped row's checkpoint (pipeline/checkpoints.py) keeps its tokens in the queue; its file keeps the K/V of
their full pages, so the row continues without prefilling them again. A file is only ever a shortcut: the
engine uses it when it holds for the row (its layout, its identity: the row's checkpoint fingerprint and
adapter, its token ids a prefix of the row's, its checksum), else the row prefills. A file goes when its row's
result is durable, when its row starts over, and at finalize when its row no longer holds a checkpoint.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Iterable, Optional

from kvbatch.engine.kv.offload import KVFile
from kvbatch.pipeline import checkpoints
from kvbatch.pipeline.queue import Queue

DIR = "kv"
_SUFFIX = ".safetensors"
_TMP_AGE_S = 3600.0  # a temporary file older than this was left by a worker that died writing it


def path_of(out_dir: Path, key: str) -> Path:
    """The file of row `key`'s K/V pages."""
    return out_dir / DIR / (hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + _SUFFIX)


def file_for(out_dir: Path, key: str, fingerprint: str, adapter: Optional[str]) -> KVFile:
    """Row `key`'s file and what its K/V is valid for: its checkpoint's fingerprint and its adapter."""
    return KVFile(str(path_of(out_dir, key)), f"{fingerprint}:{adapter or ''}")


def drop(out_dir: Path, keys: Iterable[str]) -> None:
    """These rows' files are no longer needed (their results are durable, or they start over)."""
    for k in keys:
        path_of(out_dir, k).unlink(missing_ok=True)


def prune(out_dir: Path, q: Queue) -> int:
    """Remove the files of rows that hold no checkpoint any more (finished, started over) and temporary
    files left by a worker that died writing one; returns how many went."""
    folder = out_dir / DIR
    if not folder.is_dir():
        return 0
    keep = {path_of(out_dir, k).name for k, _ in checkpoints.in_progress(q)}
    n, now = 0, time.time()
    for f in folder.iterdir():
        tmp = f.name.endswith(".tmp" + _SUFFIX)
        if (tmp and now - f.stat().st_mtime > _TMP_AGE_S) or (not tmp and f.name not in keep):
            f.unlink(missing_ok=True)
            n += 1
    return n
