"""The worker: claim rows -> engine (continuous batching) -> durable Parquet part -> ack.

It keeps about the engine's batch (`engine.max_batch`, resolved) + `worker.prefetch` rows claimed, so the batch stays
full while other workers on the same queue still get rows. A background thread
renews its leases (a long row may not yield for a long time). Rows that the input
stage marked invalid, and rows that could not be tokenized, are written with
`invalid_input` without reaching the engine. `internal_error` rows are given back
for another attempt up to `worker.max_attempts`.

Crashes (see pipeline/queue.py) are not attempts. The queue is told which rows run in
the engine (handed to it, finished there), so a crash is charged only to those. A row
that was running when a worker died `worker.isolate_after` times runs alone (nothing
else claimed while it runs, the rows finished before it written first, and it is
written as soon as it finishes), so a row that kills its worker takes no batch mates
with it; at `worker.max_crashes`, after the crashes it caused running alone, it is
written with `internal_error` without running again.

Only exceptions out of the engine are charged to the rows in flight (retry, then
`internal_error`). A storage fault (disk full writing a part, SQLite unable to write)
is not the rows' fault: it propagates as StorageError and the run stops with one line;
nor is a device that stops evaluating (the engine's DeviceFailure: after CUDA's "illegal
memory access" every later evaluation in the process fails, so retrying rows there would
only end them all with internal_error): the rows finished before it are written and the run
stops with one line. Every exit path hands the worker's leased rows back, attempts not
counted; they continue from their last checkpoints in the next run.

Across hosts (a PostgreSQL queue): a worker knows whether another worker is alive from its
process only on its own host (`worker.host`); rows held by workers on other hosts come back
only when their leases expire. So a worker with nothing left to claim does not exit while
such rows are leased: it waits for them (claiming each one whose lease runs out), and ends
when none is left, so the rows of a worker killed or frozen on another machine are never
stranded.

`worker.deadline`: the worker looks between engine steps at least every HEARTBEAT_S, so
the deadline is seen mid-batch: the worker claims nothing more, checkpoints every row in flight
(pipeline/checkpoints.py), cancels the engine (in-flight rows go back to the queue, their attempt
not counted: they continue from their checkpoints next run, on any worker), writes the rows already
finished, and returns. `debug.deadline_after_rows=N` / `debug.deadline_after_tokens=N` (tests) reach
the deadline once N rows have a result / N tokens were generated in this run, the same place on any
machine. The first Ctrl-C or SIGTERM does the same at the next step (then exits 130 / 143); a
second one exits at once (finished rows written, rows handed back; their last checkpoints hold).
While it works, the worker checkpoints its rows every `worker.checkpoint_every` (seconds, and/or
tokens of a row), so a kill -9 loses at most the tokens since then.

`action=score`: each row's completion is scored instead of generated (pipeline/score.py: its tokens;
engine/scoring.py: the engine row that scores them); it is claimed, written and acknowledged as a
generated row is, and has nothing to checkpoint (it is one prefill).
"""
from __future__ import annotations

import math
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from kvbatch.engine.backend import device_works
from kvbatch.engine.errors import INTERNAL_ERROR, INVALID_INPUT, DeviceFailure
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.resume import CheckpointRefused, RowCheckpoint
from kvbatch.engine.types import Request, Result
from kvbatch.engine import scoring
from kvbatch.pipeline import checkpoints, debug, engine_stats, job_identity, kept_kv, procs, response_format
from kvbatch.pipeline import row_params, samples, score
from kvbatch.pipeline.chat import transcript
from kvbatch.pipeline.config import Config
from kvbatch.pipeline.durations import deadline_at
from kvbatch.pipeline.log import log
from kvbatch.pipeline.parts import part_name, write_part
from kvbatch.pipeline.progress import Progress
from kvbatch.pipeline.prompts import encode_rows
from kvbatch.pipeline.queue import Claimed, Queue
from kvbatch.pipeline.results import ResultRecord, fit


_UNSET = object()
HEARTBEAT_S = 0.5  # deadline and flush checks between engine steps at least this often
WAIT_S = 2.0  # nothing to claim, rows leased on other hosts: look again this often
LOCKED_WAIT_S = 0.1  # nothing claimed while rows are pending: another worker's claim held them a moment


class StorageError(Exception):
    """The output folder could not be written (disk full, read-only, SQLite failure)."""


class EngineFailure(Exception):
    """An exception out of the engine itself (not storage): charged to the rows in flight."""


def new_worker_id(host: Optional[str] = None, replica: int = 0) -> str:
    """A worker id unique across hosts and processes: <host>-[r<replica>-]<pid>-<random>."""
    rep = f"r{replica}-" if replica else ""
    return f"{host or socket.gethostname()}-{rep}{os.getpid()}-{secrets.token_hex(2)}"


class LeaseKeeper(threading.Thread):
    """Renews this worker's leases (and its heartbeat) every lease_s/3 on its own connection, and at once
    when the queue's clock stepped (a machine waking from sleep, an NTP step): the keeper judges its own
    schedule on the monotonic clock, and a lease that looks expired after a step is renewed within
    STEP_CHECK_S, before other workers take it for a dead one. With each renewal it records the output
    tokens of the rows in flight (`generated`), so the tokens a kill -9 loses are counted by the worker
    that takes the rows next."""

    STEP_CHECK_S = 0.5  # how often the queue's clock is compared with the monotonic clock
    STEP_S = 1.0  # a difference larger than this is a step

    def __init__(self, queue: Queue, worker: str, lease_s: float,
                 generated: Callable[[], dict[str, int]] = dict):
        super().__init__(daemon=True, name="kvbatch-lease")
        self.queue, self.worker, self.lease_s, self.generated = queue, worker, lease_s, generated
        self.stop_event = threading.Event()

    def run(self) -> None:
        """Renew the leases every lease_s/3 (or after a clock step) until stopped."""
        q = self.queue.reopen()  # SQLite connections belong to their thread; one connection each anyway
        every = max(self.lease_s / 3, self.STEP_CHECK_S)
        try:
            skew = q.now() - time.monotonic()
            renewed = time.monotonic()
            while not self.stop_event.wait(self.STEP_CHECK_S):
                stepped = abs(q.now() - time.monotonic() - skew) > self.STEP_S
                if stepped or time.monotonic() - renewed >= every:
                    q.renew(self.worker, self.lease_s, self.generated())
                    skew, renewed = q.now() - time.monotonic(), time.monotonic()
        except Exception:  # noqa: BLE001 - the queue is gone for good: the worker's own call says so, in one line
            return
        finally:
            q.close()

    def stop(self) -> None:
        """Stop renewing and wait for the thread to end."""
        self.stop_event.set()
        self.join(timeout=10)


@dataclass
class Runtime:
    """What the worker needs from the engine side, loaded once per process."""

    tokenizer: Any
    model_name: str
    make_engine: Callable[[], Any]  # a fresh Engine (after an engine-level failure, the old one is dropped)
    context_length: int = 0  # the model's context: no row generates past it (0: unknown)
    reasoning: Any = None  # the job's reasoning tags for this model (engine/reasoning.py; None: no reasoning)


@dataclass
class WorkStats:
    """What one worker run did: rows, tokens, wall time, retries, released rows and whether the deadline stopped it."""

    rows: int = 0
    tokens: int = 0  # generated in this run (rows finished, and rows in flight when it stopped)
    wall_s: float = 0.0
    retried: int = 0
    released: int = 0  # in-flight rows handed back (deadline, Ctrl-C, SIGTERM)
    gave_up: int = 0  # rows ended at worker.max_crashes
    stopped_by_deadline: bool = False
    engine_summary: dict = field(default_factory=dict)
    resumed_tokens: int = 0  # output tokens rows started with: carried over from checkpoints
    # tokens generated beyond the rows' last checkpoints: by rows this run handed back, and (as its lease
    # heartbeat last recorded them) by a worker that died holding rows this run took over
    lost_tokens: int = 0
    checkpoints: int = 0  # row checkpoints saved
    checkpoint_s: float = 0.0  # time spent taking and saving them (what checkpoints cost the run)
    kept_at_stop: int = 0  # tokens of the rows in flight checkpointed at the stop (deadline, Ctrl-C, SIGTERM)
    kv_kept_tokens: int = 0  # ... of them, tokens whose K/V pages were kept on disk too (worker.keep_kv)
    kv_save_s: float = 0.0  # time spent writing those pages
    started_over: dict = field(default_factory=dict)  # reason -> rows whose checkpoint could not be used
    workers_rss_bytes: int = 0  # worker.processes > 1: the workers' peak resident memory, added up

    def plus(self, other: "WorkStats", at_once: bool) -> "WorkStats":
        """Two runs' counts as one: worker processes side by side (`at_once`), or a job's second pass after its
        first. Counts and times add up, the deadline stopped it if it stopped either; the engines' figures merge
        as pipeline/engine_stats.py says."""
        summary = engine_stats.merge(self.engine_summary, other.engine_summary, at_once)
        return WorkStats(
            rows=self.rows + other.rows, tokens=self.tokens + other.tokens, wall_s=self.wall_s + other.wall_s,
            retried=self.retried + other.retried, released=self.released + other.released,
            gave_up=self.gave_up + other.gave_up,
            stopped_by_deadline=self.stopped_by_deadline or other.stopped_by_deadline,
            engine_summary=summary, resumed_tokens=self.resumed_tokens + other.resumed_tokens,
            lost_tokens=self.lost_tokens + other.lost_tokens, checkpoints=self.checkpoints + other.checkpoints,
            checkpoint_s=self.checkpoint_s + other.checkpoint_s, kept_at_stop=self.kept_at_stop + other.kept_at_stop,
            kv_kept_tokens=self.kv_kept_tokens + other.kv_kept_tokens, kv_save_s=self.kv_save_s + other.kv_save_s,
            started_over={k: self.started_over.get(k, 0) + other.started_over.get(k, 0)
                          for k in {*self.started_over, *other.started_over}},
            workers_rss_bytes=(self.workers_rss_bytes + other.workers_rss_bytes if at_once
                               else max(self.workers_rss_bytes, other.workers_rss_bytes)))


class Worker:
    """Claims rows from the queue, runs them through one engine, writes finished rows as parts and acknowledges them."""

    def __init__(self, cfg: Config, queue: Queue, parts_dir: Path, runtime: Runtime,
                 worker_id: Optional[str] = None, progress: Optional[Progress] = None,
                 after_checkpoint: Optional[Callable[[], None]] = None):
        self.cfg, self.q, self.parts_dir, self.rt = cfg, queue, parts_dir, runtime
        self.after_checkpoint = after_checkpoint  # checkpoints were saved (a shard copies them out: shards.py)
        self.host = cfg.worker.host or socket.gethostname()
        self.id = worker_id or cfg.worker.id or new_worker_id(self.host, cfg.worker.replica)
        self.storage_errors = (OSError, *queue.storage_errors)  # the folder's or the queue's fault, never a row's
        self.progress = progress
        self.deadline = deadline_at(cfg.worker.deadline)
        self.eng = None
        self.inflight: dict[str, Claimed] = {}
        self.params: dict[str, SamplingParams] = {}  # of the rows in flight: their results columns come from these
        self.buffer: list[ResultRecord] = []
        self.seq = 0
        self.last_flush = time.monotonic()
        self.stats = WorkStats()
        self.alone: Optional[str] = None  # key of a row running alone (isolate_after crashes)
        self.slots = samples.slots_of(queue.get_meta(samples.META))  # queue positions per input row
        self.seen_tokens = 0  # the current engine's generated tokens already reported to progress
        self.results = 0  # rows given a result in this run (debug.deadline_after_rows)
        self.job_format = _UNSET  # job.response_format, resolved on first use
        # rows in flight: fingerprint (what their kept tokens are valid for), tokens at their last
        # checkpoint (or resume), checkpoints saved of them (every run)
        self.fps: dict[str, str] = {}
        self.saved: dict[str, int] = {}
        self.saves: dict[str, int] = {}
        self.last_checkpoint = time.monotonic()
        self.stopping: Optional[KeyboardInterrupt] = None  # the first Ctrl-C / SIGTERM: stop at the next step
        self.identity = queue.get_meta(job_identity.META)  # the job its parts belong to (None: not recorded)
        self.out_dir = parts_dir.parent  # the job's folder: kept K/V pages go to its kv/ (pipeline/kept_kv.py)
        self.scoring = cfg.action == "score"  # rows score their completion (pipeline/score.py), nothing generated
        self.scorers: dict[str, tuple[scoring.TeacherForced, list[int], int]] = {}  # (scorer, text, prompt length)

    # ---- records ---------------------------------------------------------------------------
    def _sampling(self, row: Claimed) -> SamplingParams:
        """The parameters the row runs with (built once per row: the engine's Request keeps them)."""
        payload = row.payload
        tags = self.rt.reasoning
        return row_params.sampling(payload, self.cfg, seed=samples.seed_for(payload, row.key, self.cfg.sampling.seed),
                                   grammar=response_format.grammar(self._format(payload)), reasoning=tags,
                                   max_reasoning_tokens=self.cfg.job.max_reasoning_tokens if tags else None)

    def _format(self, payload: dict):
        """The row's response format (resolved): its own, else the job's."""
        if "response_format" in payload:
            return payload["response_format"]
        if self.job_format is _UNSET:
            self.job_format = response_format.resolve(self.cfg.job.response_format)
        return self.job_format

    def _adapter(self, payload: dict) -> Optional[str]:
        """The row's LoRA adapter by name: its own, else the job's (None: the model as loaded)."""
        return payload["adapter"] if "adapter" in payload else self.cfg.job.adapter

    def _record(self, c: Claimed, res: Optional[Result] = None, code: Optional[str] = None,
                msg: Optional[str] = None, params: Optional[SamplingParams] = None) -> ResultRecord:
        """The row's result: from the engine's Result, or an error that never reached the engine.
        `params`: those it ran with (else made here, for a row that never reached the engine)."""
        rec = ResultRecord(row_key=c.key, row_index=c.pos // self.slots, sample_index=c.payload.get("sample_index", 0),
                           job=self.cfg.job.name, run_id=self.id,
                           prompt=c.payload.get("prompt"), model=self.rt.model_name, kv_mode=self.cfg.kv.mode,
                           attempt=c.attempt, worker=self.id, error_code=code, error_message=msg)
        if self.scoring:
            rec.score_column = c.payload.get("score_column")
        elif "error" not in c.payload:
            p = params or self._sampling(c)
            fmt = response_format.canonical(self._format(c.payload)) if p.grammar else None
            for name, value in row_params.columns(p, response_format=fmt, adapter=self._adapter(c.payload)).items():
                setattr(rec, name, value)
        else:  # the seed it would have run with: the column never null, an integer column in pandas too
            rec.seed = samples.seed_for(c.payload, c.key, self.cfg.sampling.seed)
        if res is not None and self.scoring:
            self._scored(rec, c, res)
        elif res is not None:
            s = res.stats
            rec.output, rec.output_token_ids, rec.output_tokens = res.text, list(res.tokens), len(res.tokens)
            rec.reasoning, rec.answer = res.reasoning, res.answer
            rec.finish_reason, rec.error_code, rec.error_message = res.finish_reason, res.error_code, res.error_message
            rec.prompt_tokens, rec.ttft_s, rec.decode_tps = s.prompt_tokens, s.ttft_s, s.decode_tps
            rec.queue_s, rec.preemptions, rec.cached_tokens = s.queue_s, s.preemptions, s.cached_tokens
            rec.spec_proposed, rec.spec_accepted = s.spec_proposed, s.spec_accepted
            rec.resumed_tokens, rec.checkpoints = s.resumed_tokens, self.saves.get(c.key, 0)
            rec.wall_s, rec.peak_kv_bytes, rec.route = s.wall_s, s.peak_kv_bytes, s.route or None
            rec.stop_reason = res.stop_reason
            if res.error_code is None:
                rec.messages = transcript(c.payload, self.cfg.job, res.text)
            lp = res.logprobs
            if lp is not None and (lp.tokens or lp.top):
                rec.output_logprobs, rec.cumulative_logprob = lp.tokens, lp.total
                rec.top_logprobs = [[{"token_id": t, "logprob": v} for t, v in top] for top in lp.top]
            if lp is not None and lp.prompt is not None:
                rec.prompt_logprobs = lp.prompt
        return rec

    def _scored(self, rec: ResultRecord, c: Claimed, res: Result) -> None:
        """A scored row's columns: the completion as its output, its log-probabilities (pipeline/score.py)."""
        sc, text, prompt_len = self.scorers.pop(c.key)
        s = res.stats
        rec.prompt_tokens, rec.cached_tokens, rec.queue_s, rec.preemptions = prompt_len, s.cached_tokens, s.queue_s, \
            s.preemptions
        rec.wall_s, rec.peak_kv_bytes, rec.route = s.wall_s, s.peak_kv_bytes, s.route or None
        rec.error_code, rec.error_message = res.error_code, res.error_message
        lp = sc.token_logprobs() if res.error_code is None else None
        if res.error_code is None and lp is None:
            rec.error_code, rec.error_message = INTERNAL_ERROR, "the scorer did not score every completion token"
        if lp is None:
            return
        total = math.fsum(lp)
        rec.output, rec.output_token_ids, rec.output_tokens = c.payload["completion"], list(text), len(text)
        rec.finish_reason, rec.cumulative_logprob = "scored", total
        rec.mean_logprob = total / len(text)
        rec.perplexity = math.exp(-rec.mean_logprob) if rec.mean_logprob > -700 else math.inf
        rec.output_logprobs = lp if self.cfg.job.score_tokens else None
        rec.messages = transcript(c.payload, self.cfg.job, c.payload["completion"])

    def _start_scoring(self, c: Claimed) -> bool:
        """Hand a claimed row's completion to the engine's scorer; False when it never reaches the engine
        (its record written: invalid_input, or the engine refused it)."""
        try:
            prompt, text = score.tokens(self.rt.tokenizer, c.payload, self.cfg.job)
        except ValueError as exc:
            self._add(self._record(c, code=INVALID_INPUT, msg=str(exc)), unused=1)
            return False
        if c.crashes >= self.cfg.worker.isolate_after:  # a suspect: what finished before it is written first
            self.flush(force=True)
            self.alone = c.key
        req, sc = scoring.request(c.key, prompt, text)
        eng = self.eng
        assert eng is not None  # _top_up made it
        try:
            eng.add(req, score=sc)
        except Exception as exc:  # noqa: BLE001 - the engine refused this one row
            self.alone = None if self.alone == c.key else self.alone
            self._add(self._record(c, code=INTERNAL_ERROR, msg=f"the engine refused this row: "
                                                              f"{type(exc).__name__}: {exc}"))
            return False
        self.inflight[c.key], self.params[c.key], self.saved[c.key] = c, req.sampling, 0
        self.scorers[c.key] = (sc, text, len(prompt))
        return True

    # ---- flow ------------------------------------------------------------------------------
    def _past_deadline(self) -> bool:
        """Whether the run must stop now: a first Ctrl-C / SIGTERM, or the deadline (real or debug)."""
        if self.stopping is not None:
            return True
        d = self.cfg.debug
        if (self.deadline is not None and time.time() >= self.deadline) or \
                (d.deadline_after_rows is not None and self.results >= d.deadline_after_rows) or \
                (d.deadline_after_tokens is not None and self.stats.tokens >= d.deadline_after_tokens):
            self.stats.stopped_by_deadline = True
            return True
        return False

    def _top_up(self) -> int:
        """Claim rows up to the batch + prefetch; returns how many were claimed."""
        if self._past_deadline() or self.alone:
            return 0
        w = self.cfg.worker
        if self.eng is None:
            self.eng = self.rt.make_engine()
            self.seen_tokens = self.eng.generated_tokens
        want = self.eng.max_batch + w.prefetch - len(self.inflight)  # the resolved batch (auto: a number)
        claimed = self.q.claim(self.id, want, w.lease_s, idle=not self.inflight,
                               isolate_after=w.isolate_after, max_crashes=w.max_crashes)
        started: list[str] = []
        plain = [] if self.scoring else [c for c in claimed if "error" not in c.payload]
        ids_of = dict(zip((c.key for c in plain), encode_rows(self.rt.tokenizer, [c.payload for c in plain],
                                                              self.cfg.job)))
        for c in claimed:
            self.stats.lost_tokens += c.lost_tokens  # made by a worker that died, beyond the checkpoint
            if c.crashes >= w.max_crashes and c.alone_crashes >= w.max_crashes - w.isolate_after:
                self.stats.gave_up += 1
                self._add(self._record(c, code=INTERNAL_ERROR, msg=(
                    f"a worker process died {c.crashes} times while this row was running "
                    f"({c.alone_crashes} of them with the row running alone); not run again "
                    f"(worker.max_crashes={w.max_crashes})")))
            elif "error" in c.payload:
                self._add(self._record(c, code=INVALID_INPUT, msg=c.payload["error"]))
            elif self.scoring:
                if self._start_scoring(c):
                    started.append(c.key)
            else:
                p = self._sampling(c)
                ids = ids_of[c.key]
                if isinstance(ids, ValueError):
                    self._add(self._record(c, code=INVALID_INPUT, msg=str(ids), params=p))
                    continue
                if c.crashes >= w.isolate_after:  # a suspect: what finished before it is written first
                    self.flush(force=True)
                    self.alone = c.key
                req = Request(key=c.key, prompt_tokens=ids, sampling=p, group=c.payload.get("group"),
                              adapter=self._adapter(c.payload))
                fp = checkpoints.fingerprint(self.cfg, self.rt.model_name, p, ids)
                try:
                    kept = self._add_to_engine(req, fp)
                except Exception as exc:  # noqa: BLE001 - the engine refused this one row
                    self.alone = None if self.alone == c.key else self.alone
                    self._add(self._record(c, code=INTERNAL_ERROR, params=p, msg=f"the engine refused this row: "
                                                                                 f"{type(exc).__name__}: {exc}"))
                    continue
                self.inflight[c.key], self.params[c.key], self.fps[c.key] = c, p, fp
                self.saved[c.key] = kept
                self.stats.resumed_tokens += kept
                started.append(c.key)
        self.q.mark_running(self.id, started, True)
        return len(claimed)

    def _add_to_engine(self, req: Request, fp: str) -> int:
        """Hand a claimed row to the engine, continuing from its checkpoint when it has a usable one
        (else it starts over, the reason counted); returns the tokens carried over."""
        eng = self.eng
        assert eng is not None  # _top_up made it
        ck, self.saves[req.key], why = checkpoints.load(self.q, req.key, fp)
        if ck is not None:
            kv = kept_kv.file_for(self.out_dir, req.key, fp, req.adapter) if self.cfg.worker.keep_kv else None
            try:
                eng.add(req, checkpoint=ck, kv_file=kv if kv is not None and os.path.exists(kv.path) else None)
                return len(ck.tokens)
            except CheckpointRefused:
                why = checkpoints.UNUSABLE
                checkpoints.discard(self.q, [req.key], why)
        if why:  # its kept K/V pages, if any, belong to the tokens it no longer continues from
            kept_kv.drop(self.out_dir, [req.key])
            self.stats.started_over[why] = self.stats.started_over.get(why, 0) + 1
        eng.add(req)
        return 0

    def checkpoint(self, min_new: int = 1) -> dict[str, RowCheckpoint]:
        """Save the checkpoints of the engine's rows that hold at least `min_new` tokens more than at
        their last checkpoint; returns those saved."""
        eng = self.eng
        if eng is None:
            return {}
        t0 = time.perf_counter()
        cks = self._engine(lambda: eng.checkpoints(self.saved, min_new))
        items = [(k, self.fps[k], ck) for k, ck in cks.items() if k in self.fps]
        stored = checkpoints.save(self.q, self.id, items) if items else []
        for k in stored:
            self.saved[k] = len(cks[k].tokens)
            self.saves[k] = self.saves.get(k, 0) + 1
        self.stats.checkpoints += len(stored)
        if stored and self.after_checkpoint is not None:
            self.after_checkpoint()
        self.stats.checkpoint_s += time.perf_counter() - t0
        return {k: cks[k] for k in stored}

    def _row_tokens(self) -> dict[str, int]:
        """The output tokens of the engine's rows now (read by the lease thread)."""
        eng = self.eng
        return eng.row_tokens() if eng is not None else {}

    def _checkpoint_due(self) -> None:
        """worker.checkpoint_every.seconds (looked at on the heartbeat): every row once the interval passed."""
        every, now = self.cfg.worker.checkpoint_every.seconds, time.monotonic()
        if every and now - self.last_checkpoint >= every:
            self.checkpoint()
            self.last_checkpoint = now

    def _forget(self, key: str) -> None:
        """A row leaves this worker (finished, retried): its checkpoint bookkeeping goes (_drop_rows: all rows)."""
        for d in (self.fps, self.saved, self.saves, self.scorers):
            d.pop(key, None)

    def _finished_all(self, done: list[Result]) -> None:
        """Rows out of one engine step: no longer running (a crash now is not theirs); a suspect that
        finished is written at once, so it is never charged with a later crash."""
        if not done:
            return
        self.q.mark_running(self.id, [r.key for r in done], False)
        suspect = any(self.inflight[r.key].crashes for r in done if r.key in self.inflight)
        for res in done:
            self._finished(res)
        if suspect:
            self.flush(force=True)

    def _finished(self, res: Result) -> None:
        c, p = self.inflight.pop(res.key), self.params.pop(res.key, None)
        if self.alone == res.key:
            self.alone = None
        if res.error_code == INTERNAL_ERROR and c.attempt < self.cfg.worker.max_attempts:
            self.q.release(self.id, [c.key], "retry")
            self.stats.retried += 1
            self._forget(c.key)
            return
        self._add(self._record(c, res, params=p), unused=int(res.error_code is not None))
        self._forget(c.key)

    def _add(self, record: ResultRecord, unused: int = 0) -> None:
        """Buffer a row's record for the next part; `unused`: a scored row's budgeted token it did not use."""
        self.buffer.append(fit(record))  # always writable: one bad value never fails a part
        self.results += 1
        if self.progress and record.score_column is not None:  # one token sampled after its text (ignored)
            self.progress.row_done(unused, None if record.error_code else 1)
        elif self.progress:
            budget = getattr(record, "max_tokens", None) or 0  # set for every row that was meant to run
            budget = min(budget, self.rt.context_length or budget)  # as the job's budget counted it
            # tokens it will not generate here: beyond its output, and those carried over from a checkpoint
            self.progress.row_done(budget - (record.output_tokens or 0) + (record.resumed_tokens or 0),
                                   None if record.error_code else record.output_tokens or 0)

    def _tick(self) -> None:
        """The tokens generated since the last step: counted, and shown on the progress line."""
        if self.eng is not None:
            n = self.eng.generated_tokens
            self.stats.tokens += n - self.seen_tokens
            if self.progress:
                self.progress.tokens(n - self.seen_tokens)
                self.progress.speculation = self.eng.speculation
            self.seen_tokens = n

    def flush(self, force: bool = False) -> None:
        """Write buffered results as one durable part, then acknowledge its rows."""
        due = len(self.buffer) >= self.cfg.worker.flush_rows or \
            time.monotonic() - self.last_flush >= self.cfg.worker.flush_s
        if not self.buffer or not (force or due):
            return
        name = part_name(self.id, self.seq)
        write_part(self.parts_dir, name, self.buffer, before_rename=lambda: debug.point("part_tmp"), job=self.identity)
        debug.point("after_part_write")
        self.q.ack(self.id, [(r.row_key, r.error_code) for r in self.buffer], name)
        debug.point("after_ack")
        kept = [r.row_key for r in self.buffer if r.checkpoints]
        checkpoints.clear(self.q, kept)
        kept_kv.drop(self.out_dir, kept)
        self.seq += 1
        self.stats.rows += len(self.buffer)
        self.q.worker_progress(self.id, self.stats.rows, self.stats.tokens)
        self.buffer, self.last_flush = [], time.monotonic()

    def _engine_failed(self, exc: BaseException) -> None:
        """An exception out of the engine itself: its rows retry (or end with internal_error)."""
        msg = f"{type(exc).__name__}: {exc}"
        log.warning("kvbatch: warning: the engine failed (%s); its %d rows in flight retry in a new engine (up to "
                    "worker.max_attempts)", msg, len(self.inflight))
        for c in list(self.inflight.values()):
            if c.attempt < self.cfg.worker.max_attempts:
                self.q.release(self.id, [c.key], "retry")
                self.stats.retried += 1
            else:
                self._add(self._record(c, code=INTERNAL_ERROR, msg=msg, params=self.params.get(c.key)))
        self._drop_rows()
        self.eng = None

    def _give_back(self, outcome: str) -> None:
        """Return in-flight rows to the queue without counting the attempt (deadline, Ctrl-C)."""
        if self.inflight:
            self.q.release(self.id, list(self.inflight), outcome, count_attempt=False)
            self.stats.released += len(self.inflight)
        self._drop_rows()

    def _drop_rows(self) -> None:
        """Every row in flight leaves this worker at once (handed back, retried or ended): its state goes."""
        for d in (self.inflight, self.params, self.fps, self.saved, self.saves, self.scorers):
            d.clear()
        self.alone = None

    def _stop_engine(self, eng) -> None:
        """The run stops (deadline, Ctrl-C, SIGTERM): every row in flight is checkpointed, then the
        engine cancelled (its rows are handed back by _give_back). Tokens beyond what could be saved
        are counted lost."""
        at_stop = self._engine(eng.checkpoints)
        self._best_effort(lambda: self.checkpoint())
        self.stats.kept_at_stop += sum(self.saved.get(k, 0) for k in at_stop)
        self.stats.lost_tokens += sum(len(ck.tokens) - self.saved.get(k, 0) for k, ck in at_stop.items())
        if self.cfg.worker.keep_kv:
            self._best_effort(lambda: self._keep_kv(eng, [k for k in at_stop if self.saved.get(k)]))
        self._engine(eng.cancel)

    def _keep_kv(self, eng, keys: list[str]) -> None:
        """worker.keep_kv: the checkpointed rows' full K/V pages into the job's kv/ (pipeline/kept_kv.py), so
        they continue without prefilling their kept tokens again. A failure (a full disk) keeps no file:
        the rows prefill then."""
        t0 = time.perf_counter()
        (self.out_dir / kept_kv.DIR).mkdir(exist_ok=True)
        files = {k: kept_kv.file_for(self.out_dir, k, self.fps[k], self._adapter(self.inflight[k].payload))
                 for k in keys if k in self.fps and k in self.inflight}
        try:
            self.stats.kv_kept_tokens += sum(eng.save_kv(files, {k: self.saved[k] for k in files}).values())
        finally:
            self.stats.kv_save_s += time.perf_counter() - t0

    def _drive(self) -> None:
        """Step the engine over the rows in flight (a step is one decode step, so the worker looks
        often). At the deadline, cancel it: the rows it hands back stay in `inflight` for
        _give_back, rows that had finished still come out of step(). Otherwise, when rows
        finished or every HEARTBEAT_S, top the batch up and flush (the queue is not asked every step)."""
        eng = self.eng
        if eng is None:
            return
        cancelled = False
        last = time.monotonic()
        by_tokens = self.cfg.worker.checkpoint_every.tokens
        while self._engine(eng.has_unfinished):
            done = self._engine(eng.step)
            self._tick()
            self._finished_all(done)
            if cancelled:
                continue
            if self._past_deadline():
                self._stop_engine(eng)
                cancelled = True
                continue
            if by_tokens:  # rows that made that many tokens since their last checkpoint (a scan of the batch)
                self.checkpoint(by_tokens)
            if done or time.monotonic() - last >= HEARTBEAT_S:
                last = time.monotonic()
                self._checkpoint_due()
                self._top_up()
                self.flush()

    @staticmethod
    def _engine(call: Callable[[], Any]) -> Any:
        """One call into the engine: its exceptions become EngineFailure (charged to the rows in
        flight), or DeviceFailure where the device no longer evaluates anything (no row's fault); the
        worker's own storage calls stay outside, so a full disk is never a row's fault."""
        try:
            return call()
        except DeviceFailure:
            raise
        except Exception as exc:  # noqa: BLE001
            if not device_works():
                raise DeviceFailure(f"{type(exc).__name__}: {exc}") from exc
            raise EngineFailure(f"{type(exc).__name__}: {exc}") from exc

    def _take_over(self, host: str) -> bool:
        """Nothing left to claim: rows still leased by dead or ended workers come back to this one; rows
        pending but locked by another worker's claim at that moment are claimed again; rows leased by
        workers on other hosts are waited for (they come back when their leases expire)."""
        if self.q.expire_dead_workers(host, procs.alive) > 0:
            return True
        if self.q.counts()["pending"]:  # an idle worker claims any pending row it can see: these were
            time.sleep(LOCKED_WAIT_S)  # locked by a claim on another connection (PostgreSQL), now over
            return True
        until = self.q.leased_elsewhere(host)
        if until is None:
            return False
        time.sleep(min(max(until - self.q.now(), 0.0) + 0.05, WAIT_S))
        return True  # claim again (a deadline that passed meanwhile stops the loop there)

    def run(self) -> WorkStats:
        """Work until the queue has nothing claimable (or the deadline passes)."""
        t0 = time.perf_counter()
        host = self.host
        self.q.worker_started(self.id, os.getpid(), host)
        keeper = LeaseKeeper(self.q, self.id, self.cfg.worker.lease_s, self._row_tokens)
        keeper.start()
        stop = "failed"
        old_handlers = self._on_stop_signals()
        try:
            while self._top_up() or self.inflight or self.buffer or \
                    (not self._past_deadline() and self._take_over(host)):
                if self.inflight:
                    try:
                        self._drive()
                    except EngineFailure as exc:  # confined to the rows in flight
                        self._engine_failed(exc.__cause__ or exc)
                self.flush(force=True)
                if self._past_deadline():
                    break
            if self.stopping is not None:  # the first Ctrl-C / SIGTERM: work kept, now exit as interrupted
                self._give_back("interrupted")
                self.flush(force=True)
                raise self.stopping
            self._give_back("deadline" if self.stats.stopped_by_deadline else "released")
            self.flush(force=True)
            stop = "deadline" if self.stats.stopped_by_deadline else "finished"
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what is done, hand the rest back at once
            stop = "interrupted"
            self._best_effort(lambda: self.flush(force=True))
            raise
        except self.storage_errors as exc:
            stop = "storage"
            raise StorageError(f"{type(exc).__name__}: {exc}") from None
        except DeviceFailure:  # no row's fault: the finished rows are written, the rest handed back uncharged
            stop = "device"
            self.flush(force=True)
            raise
        finally:
            _restore_signals(old_handlers)
            keeper.stop()
            self.stats.wall_s = time.perf_counter() - t0
            if self.eng is not None:
                self.stats.engine_summary = self._best_effort(self.eng.stats) or {}
            # every exit path: what this worker still holds goes back, attempts not counted
            self.stats.released += len(self.inflight)
            self._best_effort(lambda: self.q.release_worker(self.id, stop if stop != "finished" else "released"))
            self._best_effort(lambda: self.q.worker_ended(self.id, self.stats.rows, self.stats.tokens,
                                                          self.stats.wall_s, self.stats.engine_summary, stop))
        return self.stats

    @staticmethod
    def _best_effort(call: Callable[[], Any]) -> Any:
        """Cleanup on the way out must not hide why the worker stopped (a full disk fails these too;
        the next start frees the rows of a worker that is gone)."""
        try:
            return call()
        except Exception:  # noqa: BLE001
            return None


    def _on_stop_signals(self) -> dict:
        """Ctrl-C and SIGTERM (systemd stop, `timeout`, kill, a scheduler's pre-emption): the first
        one asks the run to stop at the next engine step (rows checkpointed, handed back); a second
        one raises at once (Terminated for SIGTERM). Returns the handlers it replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            exc = Terminated(f"signal {signum}") if signum == signal.SIGTERM else KeyboardInterrupt()
            if self.stopping is None:
                self.stopping = exc
                return
            raise exc

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (exit status 143 instead of 130)."""


def _restore_signals(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)
