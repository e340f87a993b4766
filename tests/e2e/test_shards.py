"""Sharded jobs without a server (queue.shards=N, worker.shard=i): real processes, real Parquet, the tiny model.

Four shards run as four `python -m kvbatch` processes at once beside one unsharded run of the same job;
one shard kills itself with SIGKILL mid-decode (pipeline/debug.py: the same as `kill -9` from outside)
after it wrote parts and checkpoints, and is run again. The merged results.parquet must hold every row
exactly once with the unsharded run's tokens; a rerun of the finished array generates nothing.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.pipeline import actions, shards
from kvbatch.pipeline.api import config_for
from kvbatch.pipeline.config import ConfigError
from kvbatch.pipeline.debug import ENV as CRASH_ENV
from kvbatch.pipeline.inputs import read_rows
from kvbatch.pipeline.log import out as out_log
from kvbatch.pipeline.samples import expand

N = 4
KILLED = 2  # the shard killed mid-decode
# 20 rows: short answers (written in parts early) and long ones (in flight, checkpointed, when the kill comes)
ROWS = [{"id": f"r{i:02d}", "prompt": f"word{i} " * (2 + i % 5), "max_tokens": (4, 24)[i % 2]} for i in range(20)]
ROWS.insert(3, {"id": "bad", "prompt": ""})  # invalid_input: a shard's error row comes back with its code
KEYS = [r["id"] for r in ROWS]
SETTINGS = {"job.chat_template": False, "engine.max_batch": 2, "worker.prefetch": 0, "worker.flush_rows": 1,
            "worker.checkpoint_every.tokens": 4, "output.progress": "off"}


def _args(settings: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def _start(out: Path, extra: list[str], base: list[str], crash: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (CRASH_ENV, shards.SLURM_TASK)}
    env["PYTHONWARNINGS"] = "ignore"
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.Popen([sys.executable, "-m", "kvbatch", *extra, *base, f"output.dir={out}"], cwd=out.parent,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _config(src: Path, out: Path, cache: Path, **more):
    return config_for(src, "tiny", "none", out, {**SETTINGS, "model.cache_dir": str(cache), **more})


def _status(src: Path, out: Path, cache: Path) -> str:
    """action=status's lines, run in this process (the array's size read from the folder)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    out_log.addHandler(handler)
    old = out_log.level
    out_log.setLevel(logging.INFO)
    try:
        actions.execute(_config(src, out, cache, action="status"))
    finally:
        out_log.removeHandler(handler)
        out_log.setLevel(old)
    return "\n".join(lines)


@pytest.fixture(scope="module")
def array(tmp_path_factory, model_cache_dir):
    """The job run two ways at once: unsharded (the reference) and as 4 shards, one of them killed and
    run again. Returns (folder, input file, reference results by key, the killed shard's rerun stderr, status
    between the kill and the rerun)."""
    d = tmp_path_factory.mktemp("shards")
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", *_args(SETTINGS)]
    out = d / "array"
    procs: dict[str | int, subprocess.Popen] = {"ref": _start(d / "ref", [], base)}
    for i in range(N):
        procs[i] = _start(out, [f"queue.shards={N}", f"worker.shard={i}"], base,
                          crash="decode:16" if i == KILLED else None)
    ended = {k: (p.wait(timeout=300), p.stderr.read() if p.stderr else "") for k, p in procs.items()}
    for k, (code, err) in ended.items():
        assert code == (-9 if k == KILLED else 0), f"{k}: {code}\n{err}"
    # the killed shard left parts and in-flight checkpoints in the folder, and no marker
    arr = shards.Array(out, N, (out / ".kvbatch-job").read_text().strip())
    assert arr.complete(KILLED) is None and arr.kept_tokens(KILLED)
    assert all(arr.complete(i) for i in range(N) if i != KILLED) and not (out / "results.parquet").exists()
    before = _status(src, out, model_cache_dir)
    rerun = _start(out, [f"queue.shards={N}", f"worker.shard={KILLED}"], base)
    code = rerun.wait(timeout=300)
    err = rerun.stderr.read() if rerun.stderr else ""
    assert code == 0, err
    # the shards' local queues are gone: the killed one's removed by the next shard to start on this host
    pids = {str(p.pid) for p in (*procs.values(), rerun)}
    left = [p for p in Path(tempfile.gettempdir()).glob("kvbatch-queue~*") if p.name.split("~")[2] in pids]
    assert not left, left
    ref = {r["row_key"]: r for r in pq.read_table(d / "ref" / "results.parquet").to_pylist()}
    assert list(ref) == KEYS and ref["bad"]["error_code"] == "invalid_input"
    return out, src, ref, err, before


def test_every_row_once_with_the_tokens_of_one_process(array):
    out, _, ref, err, _ = array
    # the rerun took up the killed shard's work: rows from its parts, rows in flight from its checkpoints
    assert re.search(rf"shard {KILLED} of {N}: \d+ rows, [1-9]\d* already in parts, [1-9]\d* continue from "
                     rf"checkpoints", err), err
    got = pq.read_table(out / "results.parquet").to_pylist()
    assert [r["row_key"] for r in got] == KEYS  # each row exactly once, in input order
    assert [r["row_index"] for r in got] == list(range(len(KEYS)))
    for r in got:
        want = ref[r["row_key"]]
        assert (r["output_token_ids"], r["error_code"], r["finish_reason"]) == \
            (want["output_token_ids"], want["error_code"], want["finish_reason"]), r["row_key"]
        assert r["worker"].startswith(f"shard{shards.shard_of(r['row_key'], N)}-")  # generated by its own shard
    # the killed shard's rows in flight continued from their checkpoints in the shared folder
    assert any(r["resumed_tokens"] for r in got if shards.shard_of(r["row_key"], N) == KILLED)
    assert not list((out / "shards").glob("*.checkpoints.parquet"))  # complete shards keep none
    assert not list(out.glob("queue.sqlite*"))  # no SQLite on the shared folder


def test_a_rerun_of_the_finished_array_generates_nothing(array, model_cache_dir):
    """The array again, as Hydra's multirun over worker.shard=range(N) (the launcher's sweep; the basic launcher
    runs its jobs in one process): every shard ends at its marker, no model loads, nothing is written."""
    out, src, _, _, _ = array
    parts = sorted(p.name for p in (out / "parts").iterdir())
    stamp = (out / "results.parquet").stat().st_mtime_ns
    base = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"job.input={src}", *_args(SETTINGS)]
    p = _start(out, ["-m", f"queue.shards={N}", f"worker.shard=range({N})",
                     f"hydra.sweep.dir={out.parent / 'sweep'}"], base)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr
    assert all(f"shard {i} of {N} is complete (" in stderr for i in range(N)), stderr
    assert "memory plan" not in stderr and f"{N} workers: {N} completed" in stderr, stderr  # no model loaded
    assert sorted(p.name for p in (out / "parts").iterdir()) == parts
    assert (out / "results.parquet").stat().st_mtime_ns == stamp  # nothing changed: not even rewritten


def test_status_reads_every_shard(array, model_cache_dir):
    out, src, _, _, before = array
    killed = re.search(rf"shard {KILLED}: in progress, ([1-9]\d*) of \d+ rows done; ([1-9]\d*) rows keep "
                       rf"([1-9]\d*) tokens in checkpoints", before)
    assert killed and before.count("complete, ") == N - 1, before
    assert f"complete: {N - 1} of {N} shards" in before and "action=finalize merges them" in before, before
    after = _status(src, out, model_cache_dir)
    assert f"shards: {N} in {out}" in after and after.count("complete, ") == N, after
    assert f"complete: {N} of {N} shards, {len(KEYS)} of {len(KEYS)} rows done; results: " in after, after


def test_shard_assignment_is_stable_on_reread(array):
    _, src, _, _, _ = array
    from kvbatch.pipeline.config import JobConfig

    job = JobConfig(input=str(src), chat_template=False)
    first = {r.key: shards.row_shard(r, N) for r in expand(read_rows(src, "auto", job), 1)}
    again = {r.key: shards.row_shard(r, N) for r in expand(read_rows(src, "auto", job), 1)}
    assert first == again and set(first.values()) == set(range(N))
    # a stable hash of the key, not Python's hash() (salted per process): pinned values
    assert [shards.shard_of(k, N) for k in ("r00", "r01", "bad")] == PINNED


PINNED = [0, 3, 3]


def test_two_configs_in_one_folder_are_refused(array, model_cache_dir):
    out, src, _, _, _ = array
    with pytest.raises(ConfigError, match="holds the rows of another config"):
        actions.execute(_config(src, out, model_cache_dir, **{"queue.shards": N, "worker.shard": 0,
                                                               "job.max_tokens": 7}))
    with pytest.raises(ConfigError, match=f"holds the work of a {N}-shard array"):
        actions.execute(_config(src, out, model_cache_dir, **{"queue.shards": N + 1, "worker.shard": 0}))


def test_the_shard_is_worker_shard_else_the_slurm_array_task(array, model_cache_dir, monkeypatch):
    out, src, _, _, _ = array
    cfg = _config(src, out, model_cache_dir, **{"queue.shards": N})
    monkeypatch.delenv(shards.SLURM_TASK, raising=False)
    with pytest.raises(ConfigError, match=f"worker.shard=0 to {N - 1}"):
        shards.index(cfg)
    monkeypatch.setenv(shards.SLURM_TASK, "2")
    assert shards.index(cfg) == 2
    cfg.worker.shard = 1
    assert shards.index(cfg) == 1  # the config wins over the environment
    cfg.worker.shard = None
    monkeypatch.setenv(shards.SLURM_TASK, str(N))
    with pytest.raises(ConfigError, match=f"--array=0-{N - 1}"):
        shards.index(cfg)
    with pytest.raises(ConfigError, match=f"worker.shard=4: must be 0 to {N - 1}"):
        _config(src, out, model_cache_dir, **{"queue.shards": N, "worker.shard": 4})
