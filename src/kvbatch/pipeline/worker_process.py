"""One worker process of `worker.processes=N` (pipeline/processes.py starts it): its config from stdin, the same
generation as a single process (`actions.generate`), and its progress and counts as JSON lines on stdout."""
from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import kvbatch.engine  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from omegaconf import OmegaConf

from kvbatch.pipeline.actions import Job, generate, open_queue
from kvbatch.pipeline.config import Config, validate
from kvbatch.pipeline.log import configure_command
from kvbatch.pipeline.processes import Relay
from kvbatch.pipeline.summary import peak_rss_bytes
from kvbatch.pipeline.worker import Terminated


def main() -> int:
    """One worker: its config from stdin, progress and counts as JSON lines on the stdout it was given."""
    # a stop before the worker's loop takes over its signals (loading the model): exit as interrupted (143), not as
    # killed by SIGTERM's default action
    signal.signal(signal.SIGTERM, _terminated)
    report = os.fdopen(os.dup(1), "w")  # the front reads this; anything else printed goes to stderr
    os.dup2(2, 1)
    configure_command()
    msg = json.load(sys.stdin)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), msg["config"]))
    assert isinstance(cfg, Config)
    validate(cfg)
    job = Job(cfg, Path(msg["input"]), Path(msg["out_dir"]), msg["config_hash"])
    relay = Relay(report)
    q = open_queue(job)
    try:
        stats = generate(job, q, int(msg["rows"]), relay)
    except SystemExit as exc:
        relay.close()
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        q.close()
    relay.finish(replace(stats, workers_rss_bytes=peak_rss_bytes()) if stats else None)
    return 0


def _terminated(signum: int, _frame: Any) -> None:
    raise Terminated(f"signal {signum}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Terminated:
        sys.exit(143)
    except KeyboardInterrupt:
        sys.exit(130)
