"""A Ray Data pipeline through kvbatch.ray, run by tests/e2e/test_ray.py inside a loopback-only network namespace.

    python ray_pipeline.py INPUT.jsonl OUT_DIR MODEL_CACHE_DIR

A local Ray cluster (2 CPUs) maps the input's rows through one kvbatch.ray.Generate actor and writes the
dataset to OUT_DIR/ray/. The first actor ever started kills itself with SIGKILL at its third decode step
(pipeline/debug.py's crash point, armed only in that process), so Ray has to restart it and run that batch
again. Prints one JSON line: whether the crash point was armed, and whether a worker log shows the kill.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ray

from kvbatch.ray import Generate

CRASH_ENV = "KVBATCH_DEBUG_CRASH_AT"  # read when kvbatch.pipeline loads, i.e. in the actor's constructor


class DiesOnce(Generate):
    """Generate, whose first instance (across processes: a marker file decides) dies mid-batch."""

    def __init__(self, marker: str, **options):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.environ[CRASH_ENV] = "decode:3"
        except FileExistsError:
            os.environ.pop(CRASH_ENV, None)
        super().__init__(**options)


def main(src: str, out: str, cache: str) -> None:
    rows = [json.loads(line) for line in Path(src).read_text().splitlines()]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, configure_logging=False)
    marker = str(Path(out) / "armed")
    ds = ray.data.from_items(rows).map_batches(
        DiesOnce, fn_constructor_kwargs={"marker": marker, "model": "tiny", "max_tokens": 8,
                                         "job": {"chat_template": False}, "model.cache_dir": cache},
        batch_size=10, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1))
    ds.write_parquet(str(Path(out) / "ray"))
    ray.shutdown()
    logs = Path(temp) / "session_latest" / "logs"
    killed = any("kvbatch-debug: killing myself at decode 3" in p.read_text(errors="replace")
                 for p in logs.glob("*.err"))
    shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps({"armed": Path(marker).exists(), "killed": killed}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
