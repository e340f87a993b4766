"""The actions behind `action=`: run (enqueue + work + finalize), enqueue, work, status, finalize.

Everything that can fail on config or input (bad values, missing file, unknown
format, missing column) happens before the model loads; the model loads only
when the queue has rows to generate, so re-running a finished job is instant.
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, cast

from omegaconf import OmegaConf

from kvbatch.engine.errors import INSUFFICIENT_MEMORY, DeviceFailure
from kvbatch.engine.params import INT32_MAX
from kvbatch.engine.sizes import fmt_bytes

from kvbatch.pipeline import durations, job_identity, kept_kv, locate, model_defaults, passthrough, procs, samples
from kvbatch.pipeline import score, shards
from kvbatch.pipeline import summary as summ
from kvbatch.pipeline.config import (Config, ConfigError, as_dict, as_stored, config_hash, engine_config,
                                     parse_injection, stored_yaml)
from kvbatch.pipeline.finalize import RESULTS, Finalized, finalize, reconcile, regenerate
from kvbatch.pipeline.log import log, out
from kvbatch.pipeline.inputs import detect_format, read_rows, resolve_input
from kvbatch.pipeline.progress import Progress, row_budget
from kvbatch.pipeline.redact import redact
from kvbatch.pipeline.parts import PART_GLOB
from kvbatch.pipeline.queue import Queue, open_store
from kvbatch.pipeline.worker import Runtime, StorageError, Terminated, WorkStats, Worker, new_worker_id

QUEUE = locate.QUEUE


@dataclass
class Job:
    """One job as the actions see it: its config, input file, output folder and config hash."""

    cfg: Config
    input_path: Path
    out_dir: Path
    config_hash: str

    @property
    def queue_path(self) -> Path:
        """The SQLite queue's file (queue.url empty)."""
        return self.out_dir / QUEUE

    @property
    def queue_job(self) -> str:
        """The job's id in a shared queue database: the folder's identity (job name / config hash)."""
        return f"{self.cfg.job.name}/{self.config_hash}"

    @property
    def host(self) -> str:
        """This machine's name in the job's queue."""
        return host_name(self.cfg)


def host_name(cfg: Config) -> str:
    """This machine's name in the queue (worker.host, else the hostname)."""
    return cfg.worker.host or socket.gethostname()


def queue_exists(job: Job) -> bool:
    """Whether the job was enqueued: its queue.sqlite exists, or its database holds its rows."""
    if not job.cfg.queue.url:
        return job.queue_path.exists()
    q = Queue(open_store(job.cfg.queue.url, job.out_dir, job.queue_job))
    try:
        return q.has_job()
    finally:
        q.close()


class RowsFailed(Exception):
    """results.parquet is written, but no row succeeded or too many failed (output.max_error_fraction):
    the command exits 1 so unattended runs notice."""


def check_rows(cfg: Config, s: dict) -> None:
    """Raise RowsFailed when too many rows ended with an error code (output.max_error_fraction)."""
    why = summ.failure(s, cfg.output.max_error_fraction)
    if why:
        raise RowsFailed(why)


def job_for(cfg: Config) -> Job:
    """Where this config's rows come from and where its results go (<root>/<job>/<config hash>)."""
    path = resolve_input(cfg.job.input)
    h = config_hash(cfg, str(path))
    out = Path(cfg.output.dir) if cfg.output.dir else Path(cfg.output.root) / cfg.job.name / h
    return Job(cfg, path, out.resolve(), h)


def say(msg: str) -> None:
    """A message for the person watching the run (the `kvbatch` logger: stderr under the command)."""
    log.info(msg)


def open_queue(job: Job) -> Queue:
    """The job's queue; ConfigError when the folder holds another config's rows (output.dir reused
    with other settings, pipeline/job_identity.py): its rows were made by that config and must not be
    passed off as this one's."""
    have = job_identity.held(job.out_dir)
    if have is not None and have != job.queue_job:
        job_identity.claim(job.out_dir, job.queue_job)  # raises: the folder is another job's
    q = Queue(open_store(job.cfg.queue.url, job.out_dir, job.queue_job))
    held = q.get_meta("config_hash")
    if held is not None and held != job.config_hash:
        q.close()
        raise ConfigError(f"output.dir={str(job.out_dir)!r} holds the rows of another config (hash {held}; this "
                          f"config is {job.config_hash}): a changed model, job, sampling or KV setting is another "
                          f"job; use a new output.dir (or leave it unset), or delete that folder to start over")
    return q


def enqueue(job: Job) -> tuple[Queue, int, int]:
    """Read the input (ConfigError on file-level problems) and enqueue it; (queue, rows, new rows).
    Rows whose content changed since they were queued, and rows refused for memory when the memory
    settings changed, are generated again (their old results superseded, see Queue.regenerate)."""
    rows = queue_rows(job)
    try:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        q = open_queue(job)
        job_identity.claim(job.out_dir, job.queue_job)
        (job.out_dir / "config.yaml").write_text(stored_yaml(job.cfg))  # never a password (pipeline/redact.py)
    except OSError as exc:  # read-only, not a folder, no space
        raise ConfigError(f"output folder {str(job.out_dir)!r} is not writable ({exc.strerror or exc}); "
                          f"set output.dir or output.root to a folder you can write") from None
    describe_job(job, q)
    changed = q.changed(rows)
    added = q.enqueue(rows)
    carry_columns(job, rows)
    if changed:
        regenerate(job.out_dir, q, changed, "input_changed")
        say(f"kvbatch: {len(changed)} rows changed in the input since they were queued "
            f"({_some(changed)}); they are generated again and their old results dropped")
    memory_changed(job, q)
    return q, len(rows), added


def scored(cfg: Config) -> tuple[str, ...]:
    """The columns whose completions action=score scores (none for generation)."""
    return tuple(cfg.job.score_columns) if cfg.action == "score" else ()


def queue_rows(job: Job) -> list:
    """The job's queue rows, read from its input (ConfigError on file-level problems): one per (input row,
    sample), or for action=score one per (input row, column scored)."""
    inputs = read_rows(job.input_path, job.cfg.job.format, job.cfg.job, scored(job.cfg))
    if detect_format(job.input_path, job.cfg.job.format) == "openai_batch":
        from kvbatch.pipeline.formats.openai_batch import DEFAULTS_NOTE

        say(f"kvbatch: {DEFAULTS_NOTE}")
    system_prompt_applies(job, inputs)
    if job.cfg.action == "score":
        return score.expand(inputs, list(job.cfg.job.score_columns))
    return samples.expand(inputs, job.cfg.sampling.n, job.cfg.sampling.temperature or 0.0)


def describe_job(job: Job, q: Queue) -> None:
    """The job's metadata in its queue: its identity, input, folder and config."""
    q.set_meta("config_hash", job.config_hash)
    q.set_meta(job_identity.META, job.queue_job)
    q.set_meta("input", str(job.input_path))
    q.set_meta("output_dir", str(job.out_dir))
    q.set_meta("config", stored_yaml(job.cfg))  # status from a host without the folder
    q.set_meta(samples.META, str(samples.SAMPLE_SLOTS))


def system_prompt_applies(job: Job, inputs: list) -> None:
    """job.system_prompt goes before a prompt row's user turn; rows that carry messages have their own
    turns: an input of only such rows would ignore it, so it is refused."""
    if job.cfg.job.system_prompt is None:
        return
    readable = [r.payload for r in inputs if "error" not in r.payload]
    if readable and all("messages" in p for p in readable):
        raise ConfigError(f"job.system_prompt={_short(job.cfg.job.system_prompt)}: every row of {job.input_path.name} "
                          f"carries messages, which it does not change (it goes before a prompt row's user "
                          f"turn); put a system turn in the messages, or remove job.system_prompt")


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n - 3] + "...")


def carry_columns(job: Job, rows: list) -> None:
    """The input's columns kvbatch does not use, for results.parquet (pipeline/passthrough.py)."""
    try:
        fmt = detect_format(job.input_path, job.cfg.job.format)
        by_pos: dict[int, list[str]] = {}
        for r in sorted(rows, key=lambda r: r.pos):  # an input row's samples share its columns
            by_pos.setdefault(r.pos // samples.SAMPLE_SLOTS, []).append(r.key)
        passthrough.write(job.out_dir, job.input_path, fmt, job.cfg.job, list(by_pos.values()))
    except Exception as exc:  # noqa: BLE001 - the rows still run; say that their extra columns will be missing
        log.warning(f"kvbatch: warning: the input's other columns cannot be carried to results.parquet "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


def memory_changed(job: Job, q: Queue) -> None:
    """insufficient_memory is final for one budget, not for another: the memory settings are not part
    of the folder's identity, so when they change, the rows refused for memory are generated again."""
    memory = json.dumps(as_dict(job.cfg)["memory"], sort_keys=True)
    before = q.get_meta("memory")
    if before is not None and before != memory:
        refused = q.keys_with_error(INSUFFICIENT_MEMORY)
        if refused:
            regenerate(job.out_dir, q, refused, "memory_changed")
            say(f"kvbatch: the memory settings changed; {len(refused)} rows refused for memory run again")
    q.set_meta("memory", memory)


def _some(keys: list[str], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def load_runtime(cfg: Config, rows: Optional[int] = None) -> Runtime:
    """Load the model and build the first engine now, so a bad model or KV mode fails at start.
    `rows`: the rows this run has to generate (its engines get batch slots for no more)."""
    from kvbatch.engine import Engine
    from kvbatch.pipeline import debug
    from kvbatch.pipeline.model_cache import load_model  # sweeps: one load per distinct model config
    from kvbatch.pipeline.prompts import check_template
    from kvbatch.pipeline.results import warm_conversion

    warm_conversion()
    model, tokenizer, spec = load_model(cfg.model)
    from kvbatch.engine.models.load import cpu_half_warning

    warning = cpu_half_warning(model, spec)
    if warning:
        log.warning(warning)
    check_template(tokenizer, cfg.job.chat_template)
    tags = reasoning_tags(cfg, tokenizer)
    ecfg = replace(engine_config(cfg), rows=rows)
    # every engine of this run gets the same hooks: debug.inject_nonfinite, device_fault_after, eval_fault_at, the
    # crash points when KVBATCH_DEBUG_CRASH_AT is set (testing only)
    hooks = debug.hooks(parse_injection(cfg.debug.inject_nonfinite), cfg.debug.device_fault_after,
                        cfg.debug.eval_fault_at)

    # speculative.method=draft: the draft model, loaded as the model is (the engine checks it shares the tokenizer)
    draft = load_model(cfg.speculative.model) if cfg.speculative.method == "draft" else None

    def engine():
        return Engine(model, tokenizer, spec, ecfg, hooks, draft=draft)

    first = [engine()]
    # the start-up plan: prompt length is per row; price rows at max_tokens plus
    # max_prompt_tokens when set (the real admission prices each row's own prompt)
    say(first[0].plan_line(cfg.job.max_tokens + (cfg.job.max_prompt_tokens or 0)))
    say(f"kvbatch: sampling defaults: {model_defaults.describe(cfg.sampling, cfg.model)}")
    if not first[0].fits(2, 1):  # a one-token prompt and one generated token: every row would be refused
        smallest = first[0].plan(2, 1)
        raise ConfigError(f"memory.budget={cfg.memory.budget!r}: the budget ({fmt_bytes(smallest['budget_bytes'])}) "
                          f"leaves no room for even one row next to the weights "
                          f"({fmt_bytes(smallest['weights_bytes'])}); the smallest row needs "
                          f"{fmt_bytes(smallest['predicted_peak_bytes'])}: raise memory.budget (or memory.fraction)")

    check_controls(cfg, first[0])

    def make_engine():
        return first.pop() if first else engine()

    return Runtime(tokenizer=tokenizer, model_name=spec.name, make_engine=make_engine,
                   context_length=spec.context_length, reasoning=tags)


def reasoning_tags(cfg: Config, tokenizer):
    """The job's reasoning tags for this model (None: no reasoning); ConfigError when
    job.max_reasoning_tokens asks for a block the model has no tags for."""
    from kvbatch.engine.reasoning import tags_of

    tags = tags_of(tokenizer, cfg.job.reasoning, templated=cfg.job.chat_template)
    if tags is None and cfg.job.max_reasoning_tokens is not None:
        raise ConfigError(f"job.max_reasoning_tokens={cfg.job.max_reasoning_tokens}: the model's chat template "
                          f"writes no reasoning tags or the job does not apply it (job.reasoning=auto found none); "
                          f"set job.reasoning=START,END")
    if tags is not None:
        say(f"kvbatch: reasoning: {tags.start} ... {tags.end} goes to the results' reasoning column, "
            f"the text after it to answer")
    return tags


def check_controls(cfg: Config, eng) -> None:
    """What only the loaded model can tell: the job's token ids inside its vocabulary, and
    job.response_format compiled against its tokenizer (else every row would fail alike)."""
    from kvbatch.engine.errors import RowError
    from kvbatch.pipeline import response_format

    from kvbatch.engine.params import PARAMS, ids_outside

    vocab = eng.spec.vocab_size
    for p in PARAMS:
        ids = list(getattr(getattr(cfg, p.section), p.name)) if p.kind == "ids" else []
        if ids_outside(ids, vocab):
            raise ConfigError(f"{p.section}.{p.name}={ids}: {ids_outside(ids, vocab)} outside the model's "
                              f"vocabulary (0 to {vocab - 1})")
    grammar = response_format.grammar(response_format.resolve(cfg.job.response_format))
    if grammar is not None:
        try:
            eng.compile_grammar(grammar)
        except RowError as exc:
            raise ConfigError(f"job.response_format: {exc.message}") from None


def work(job: Job, q: Queue, after_checkpoint: Optional[Callable[[], None]] = None,
         parts: str = PART_GLOB) -> Optional[WorkStats]:
    """Generate every claimable row; None when there was nothing to do (the model never loads).
    `after_checkpoint`: called after the worker saved checkpoints (see Worker); `parts`: the parts that
    can hold the queue's rows (a shard's own)."""
    rec = reconcile(job.out_dir, q, parts)
    if rec.adopted:
        say(f"kvbatch: {rec.adopted} rows were written by a stopped worker but not acknowledged; adopted")
    for why in rec.bad_parts.values():
        say(f"kvbatch: corrupt part moved to parts/corrupt/ (its rows run again): {why}")
    _say_foreign(rec)
    expired = q.expire_dead_workers(job.host, procs.alive)
    if expired:
        say(f"kvbatch: {expired} rows leased by dead workers on this host are back in the queue")
    counts = q.counts()
    todo = counts["pending"] + counts["leased"]
    if not todo:
        return None
    if job.cfg.worker.processes > 1:
        from kvbatch.pipeline.processes import run_workers

        # each row's budget is its max_tokens here: the context that may cut it is known once a model loads
        stats = run_workers(job.cfg, job.out_dir, job.input_path, job.config_hash, todo, new_progress(job, q, todo))
        if stats is None:
            return None
    else:
        stats = generate(job, q, todo, after_checkpoint=after_checkpoint)
    for why, n in sorted(stats.started_over.items()):
        say(f"kvbatch: {n} rows started over: their checkpoint could not be used ({why})")
    if stats.stopped_by_deadline:
        left = q.counts()
        say(f"kvbatch: deadline reached; {left['pending'] + left['leased']} rows remain queued, "
            f"{stats.kept_at_stop} tokens of rows in flight kept in checkpoints{_kv_kept(stats)} "
            f"(run the same command again to continue)")
    return stats


def new_progress(job: Job, q: Queue, rows: int, context_length: Optional[int] = None) -> Progress:
    """The run's progress over `rows` rows and the queue's token budget for them (a row ends at the model's
    context whatever its max_tokens: an OpenAI batch request without one)."""
    cap = context_length or INT32_MAX
    budget = sum(min(row_budget(p, job.cfg.job.max_tokens), cap) for p in q.todo_payloads())
    return Progress(rows, budget, job.cfg.output.progress, durations.seconds(job.cfg.output.progress_every))


def generate(job: Job, q: Queue, rows: int, progress: Optional[Progress] = None,
             after_checkpoint: Optional[Callable[[], None]] = None) -> WorkStats:
    """Load the model and run one worker over the queue until nothing is claimable (`rows`: how many rows the
    run has to generate, what its engines get batch slots for); exits (SystemExit) with one line when the
    folder, the queue or the device fails, or on Ctrl-C / SIGTERM, as the command does."""
    runtime = load_runtime(job.cfg, rows)
    _reset_peak()  # this run's peak: not an earlier run's in this process (the API, a sweep)
    progress = progress or new_progress(job, q, rows, runtime.context_length)
    try:
        stats = Worker(job.cfg, q, job.out_dir / "parts", runtime, progress=progress,
                       after_checkpoint=after_checkpoint).run()
    except StorageError as exc:  # not the rows' fault: none is charged, the next run continues
        progress.close()
        where = str(job.out_dir) if q.kind == "sqlite" else f"{job.out_dir} or the queue ({q.where})"
        log.error(f"kvbatch: error: cannot write to {where}: {exc}; rows finished before this are saved, "
                  f"no row was charged: free space (or fix the folder) and run the same command again")
        raise SystemExit(1) from None
    except DeviceFailure as exc:  # no row's fault: finished rows written, the rest handed back uncharged
        progress.close()
        left = q.counts()
        log.error(f"kvbatch: error: {exc}; finished rows are saved in parts/, no row was charged, "
                  f"{left['pending'] + left['leased']} rows remain queued and continue from their last checkpoints: "
                  f"run the same command again (a fresh process gets the device afresh)")
        raise SystemExit(1) from None
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: the worker wrote what was done, handed the rest back
        progress.close()
        left = q.counts()
        say(f"kvbatch: {'terminated' if isinstance(exc, Terminated) else 'interrupted'}; finished rows are saved in "
            f"parts/, {left['pending'] + left['leased']} rows remain queued, rows in flight continue from their "
            f"checkpoints (run the same command again to continue)")
        raise SystemExit(143 if isinstance(exc, Terminated) else 130) from None
    finally:
        progress.close()
    return stats


def _kv_kept(stats: WorkStats) -> str:
    """", N of them with their K/V pages (X s)": what worker.keep_kv wrote at the stop."""
    return f", {stats.kv_kept_tokens} of them with their K/V pages ({stats.kv_save_s:.1f}s)" \
        if stats.kv_kept_tokens else ""


def _reset_peak() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()


def _passthrough_readable(job: Job) -> None:
    """passthrough.parquet is the job's own file: a damaged one is rebuilt from the input, else named in one line
    (results.parquet is then written without the input's other columns)."""
    why = passthrough.damaged(job.out_dir)
    if why is None:
        return
    try:
        carry_columns(job, queue_rows(job))
    except Exception:  # noqa: BLE001 - the input itself is gone or changed: named below
        pass
    if passthrough.damaged(job.out_dir) is None:
        say(f"kvbatch: {job.out_dir / passthrough.FILE} could not be read ({why}); rebuilt from the input")
    else:
        say(f"kvbatch: warning: {job.out_dir / passthrough.FILE} cannot be read ({why}); results.parquet is "
            f"written without the input's other columns: delete it and run action=enqueue to rebuild it")


def _say_foreign(fin: Finalized) -> None:
    if fin.foreign:
        names = sorted(fin.foreign)
        say(f"kvbatch: warning: {len(names)} parts in {fin.path.parent / 'parts'} belong to another job "
            f"({_some(names)}: job {fin.foreign[names[0]]}); not taken")


def finish(job: Job, q: Queue, stats: Optional[WorkStats], t0: Optional[float] = None,
           prune_kv: bool = True) -> tuple[Finalized, dict]:
    """Write results.parquet (and the OpenAI batch output when asked) and summary.json from the queue and the parts;
    prune_kv: remove the kept K/V files of rows `q` holds no checkpoint of (pipeline/kept_kv.py)."""
    from kvbatch.engine.blas import blas_in_use

    stored = as_stored(job.cfg)
    meta = {"kvbatch.config": json.dumps(stored, default=str),
            "kvbatch.config_hash": job.config_hash,
            **{f"{k}.version": v for k, v in summ.versions().items()}}
    _passthrough_readable(job)
    fin = finalize(job.out_dir, q, meta)
    if prune_kv:
        kept_kv.prune(job.out_dir, q)
    if job.cfg.output.openai_batch:
        batch_output(job, fin.read())
    for why in fin.bad_parts.values():
        say(f"kvbatch: corrupt part moved to parts/corrupt/: {why}")
    _say_foreign(fin)
    if fin.requeued:
        say(f"kvbatch: {len(fin.requeued)} finished rows lost their part; they are queued again")
    run = {"rows": stats.rows, "tokens": stats.tokens, "wall_s": stats.wall_s,
           "peak_memory_bytes": stats.engine_summary.get("mlx_peak_memory_bytes"),
           "resumed_tokens": stats.resumed_tokens, "lost_tokens": stats.lost_tokens,
           "checkpoints": stats.checkpoints, "checkpoint_s": stats.checkpoint_s,
           "kv_restored_tokens": stats.engine_summary.get("kv_restored_tokens", 0),
           "kv_kept_tokens": stats.kv_kept_tokens, "kv_save_s": stats.kv_save_s,
           "workers_rss_bytes": stats.workers_rss_bytes, "engine": stats.engine_summary} if stats else None
    extra = {"job": job.cfg.job.name, "model": job.cfg.model.name, "kv_mode": job.cfg.kv.mode,
             "options": asdict(job.cfg.engine.options),  # the engine options this config ran with
             "config_hash": job.config_hash, "output_dir": str(job.out_dir), "results": str(fin.path),
             "blas": blas_in_use(), "versions": summ.versions(),
             "sampling_defaults": model_defaults.describe(job.cfg.sampling, job.cfg.model),
             "config": stored,  # every setting this run had (passwords hidden), as config.yaml
             "wall_s": time.perf_counter() - t0 if t0 is not None else None}
    s = summ.build(fin.read(list(summ.COLUMNS)), q.counts(), q.sessions(), run, extra)
    summ.write(job.out_dir / "summary.json", s)
    return fin, s


def batch_output(job: Job, table) -> None:
    """output.openai_batch: the OpenAI batch output JSONL beside results.parquet (token text for logprobs
    from the model's tokenizer, loaded only when a row has logprobs)."""
    from kvbatch.pipeline.formats import openai_batch

    decode = str
    if any(v is not None for v in table.column("output_logprobs").to_pylist()):
        from kvbatch.pipeline.model_cache import load_model

        tokenizer = load_model(job.cfg.model)[1]

        def decode(tid: int, /) -> str:
            return tokenizer.decode([tid])
    openai_batch.write_output(job.out_dir / openai_batch.FILE, table, decode)


def run(job: Job) -> Path:
    """action=run (and action=score): enqueue the input, generate (score) every row, finalize; the path of
    results.parquet."""
    t_start = time.perf_counter()
    q, n_rows, added = enqueue(job)
    if n_rows == 0:
        out.info(f"kvbatch: {job.input_path} has no rows; writing an empty results file")
    elif added < n_rows:
        say(f"kvbatch: {n_rows - added} of {n_rows} rows were already queued in {job.out_dir}")
    t0 = time.perf_counter()
    stats = work(job, q)
    if stats is None and n_rows:
        say("kvbatch: every row is already finished; nothing to generate")
    fin, s = finish(job, q, stats, t_start)
    if fin.requeued:  # lost parts: generate those rows again, once
        more = work(job, q)
        if more:
            stats = more if stats is None else replace(stats.plus(more, at_once=False),
                                                       wall_s=time.perf_counter() - t0)
        fin, s = finish(job, q, stats, t_start)
    out.info(summ.one_line(s))
    out.info(fin.path)
    check_rows(job.cfg, s)
    return fin.path


def found_jobs(job: Job) -> list[Job]:
    """status/finalize/retry: the exact folder of these options, else the job's folders by name
    (pipeline/locate.py); each with the config it was made with."""
    if job.cfg.queue.url:
        return _found_in_database(job)
    if job.cfg.output.dir:  # named explicitly: that folder, its identity checked against these options
        return [job] if job.queue_path.exists() else []
    folders, note = locate.locate(job.cfg, job.out_dir, job.cfg.action)
    if note:
        say(note)
    out = []
    for f in folders:
        if f.cfg is None or f.config_hash is None:  # a folder this schema cannot read: as the command says
            out.append(Job(job.cfg, job.input_path, f.path, job.config_hash))
            continue
        # found by the job's name: these actions only read or fix the folder, so they take its own
        # config (and hash) and need none of the options it was made with
        f.cfg.action, f.cfg.retry = job.cfg.action, job.cfg.retry
        out.append(Job(f.cfg, Path(f.input) if f.input else job.input_path, f.path, f.config_hash))
    return out


def _found_in_database(job: Job) -> list[Job]:
    """status/finalize/retry on a shared queue: this job if the database holds it, else the job's only
    job of that name there (with the config it was enqueued with); ConfigError when there are several
    (status lists them)."""
    if queue_exists(job):
        return [job]
    q = Queue(open_store(job.cfg.queue.url, job.out_dir, job.queue_job))  # only to list the jobs of this name
    try:
        named = q.jobs_named(job.cfg.job.name)
        found = []
        for jid in named:
            other = Queue(open_store(job.cfg.queue.url, job.out_dir, jid))
            try:
                text, out_dir, inp = other.get_meta("config"), other.get_meta("output_dir"), other.get_meta("input")
            finally:
                other.close()
            node = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text or "{}"))
            cfg = cast(Config, OmegaConf.to_object(node))  # a structured Config node: a Config
            cfg.action, cfg.retry, cfg.queue, cfg.worker.host = job.cfg.action, job.cfg.retry, job.cfg.queue, \
                job.cfg.worker.host
            found.append(Job(cfg, Path(inp) if inp else job.input_path, Path(out_dir or job.out_dir),
                             jid.rpartition("/")[2]))
    finally:
        q.close()
    if len(found) == 1:
        say(f"kvbatch: no job for exactly these options in {redact(job.cfg.queue.url)}; using the only job named "
            f"{job.cfg.job.name!r} there ({found[0].queue_job})")
    elif len(found) > 1 and job.cfg.action != "status":
        raise ConfigError(f"action={job.cfg.action}: {redact(job.cfg.queue.url)} holds {len(found)} jobs named "
                          f"{job.cfg.job.name!r} ({', '.join(j.queue_job for j in found)}); pass the options the "
                          f"one you mean was made with")
    return found


def status(job: Job) -> None:
    """action=status: print how far the job is (or the folders and jobs of its name to choose from)."""
    found = found_jobs(job)
    if not found and job.cfg.queue.url:
        out.info(f"kvbatch: no job {job.queue_job} in {redact(job.cfg.queue.url)} yet, nor any job named "
              f"{job.cfg.job.name!r} there (run action=enqueue or action=run)")
        return
    if not found:
        out.info(f"kvbatch: no queue in {job.out_dir} yet, nor any folder of job {job.cfg.job.name!r} under "
              f"{Path(job.cfg.output.root).resolve() / job.cfg.job.name} (run action=enqueue or action=run)")
        return
    if len(found) > 1:
        if job.cfg.queue.url:
            out.info("\n".join(f"  {j.queue_job} ({j.out_dir}; model={j.cfg.model.name} kv={j.cfg.kv.mode})"
                            for j in found))
        else:
            out.info("\n".join(f"  {locate.open_folder(j.out_dir).describe()}" for j in found))
        return
    from kvbatch.pipeline.status import lines

    j = found[0]
    q = open_queue(j)
    try:
        out.info("\n".join(lines(q, j.cfg.worker.isolate_after, j.cfg.worker.max_crashes, j.cfg.worker.lease_s,
                               host=j.host)))
    finally:
        q.close()


def retry(job: Job, q: Queue) -> None:
    """Requeue finished error rows (retry.codes; when empty every code but invalid_input, which the
    input decides: it would fail again alike); the next run regenerates them, and their old results
    are superseded (never taken back into results.parquet)."""
    from kvbatch.engine.errors import ERROR_CODES, INVALID_INPUT

    codes = job.cfg.retry.codes or [c for c in ERROR_CODES if c != INVALID_INPUT]
    keys = q.error_keys(codes)
    regenerate(job.out_dir, q, keys, "retry")
    which = ", ".join(job.cfg.retry.codes) or "any code but invalid_input: retry.codes=[invalid_input] for those"
    out.info(f"kvbatch: {len(keys)} error rows ({which}) queued again in {job.out_dir}; run the job again "
          f"(the same options: {job.out_dir / 'config.yaml'}) to regenerate them")


def execute(cfg: Config) -> Optional[Path]:
    """Run the configured action; returns results.parquet's path when one was written."""
    job = job_for(cfg)
    n = cfg.queue.shards or (shards.read_size(job.out_dir) if cfg.action in ("status", "finalize") else None)
    if n:
        return sharded(job, n)
    if cfg.action in ("run", "score"):
        return run(job)
    if cfg.action == "enqueue":
        q, n, added = enqueue(job)
        out.info(f"kvbatch: {added} new of {n} rows queued in {q.where}")
        return None
    if cfg.action == "status":
        status(job)
        return None
    if cfg.action in ("finalize", "retry"):
        found = found_jobs(job)
        job = found[0] if found else job
    if not queue_exists(job):
        raise ConfigError(f"action={cfg.action}: no queue in {job.out_dir}; run action=enqueue (or run) first")
    q = open_queue(job)
    if cfg.action == "retry":
        retry(job, q)
        return None
    if cfg.action == "work":
        memory_changed(job, q)
    stats = work(job, q) if cfg.action == "work" else None
    fin, s = finish(job, q, stats)
    out.info(summ.one_line(s))
    out.info(fin.path)
    if cfg.action == "work":
        check_rows(cfg, s)
    return fin.path


# ---- sharded jobs (queue.shards=N: no queue server, pipeline/shards.py) ---------------------------------
def sharded(job: Job, n: int) -> Optional[Path]:
    """The actions of a job split into `n` shards: run/work generate this worker's shard (run then merges
    once every shard is complete), status reads every shard's state, finalize merges them."""
    action = job.cfg.action
    if action in ("run", "work"):
        return run_shard(job, n)
    if action == "status":
        if job_identity.held(job.out_dir) is not None:
            job_identity.claim(job.out_dir, job.queue_job)  # another config's folder: refused in one line
        array = shards.Array(job.out_dir, n, job.queue_job)
        out.info("\n".join(shards.status_lines(array, queue_rows(job), job.out_dir / RESULTS)))
        return None
    if action == "finalize":
        return finalize_shards(job, n)
    if action == "score":
        raise ConfigError(f"action=score does not run sharded (queue.shards={n}): leave queue.shards unset, or use "
                          f"a PostgreSQL queue (queue.url) for several hosts")
    raise ConfigError(f"action={action}: a sharded job (queue.shards={n}) has no shared queue to {action}; each "
                      f"shard reads the input itself: use action=run (or work), status or finalize")


def _array(job: Job, n: int) -> shards.Array:
    """The folder as this job's array: its identity and size recorded (ConfigError when it is another's)."""
    try:
        job.out_dir.mkdir(parents=True, exist_ok=True)
        job_identity.claim(job.out_dir, job.queue_job)
        array = shards.Array(job.out_dir, n, job.queue_job)
        array.claim()
        if not (job.out_dir / "config.yaml").exists():
            shards.write_text(job.out_dir / "config.yaml", stored_yaml(job.cfg))
    except OSError as exc:
        raise ConfigError(f"output folder {str(job.out_dir)!r} is not writable ({exc.strerror or exc}); "
                          f"set output.dir or output.root to a folder you can write") from None
    return array


def run_shard(job: Job, n: int) -> Optional[Path]:
    """Generate this worker's shard: its rows scheduled by a queue on local disk, its parts, checkpoints and
    completion marker in the shared folder. A complete shard is skipped. action=run: once every shard is
    complete, results.parquet is written (by whichever shard finishes last)."""
    i = shards.index(job.cfg)
    rows = [r for r in queue_rows(job) if shards.row_shard(r, n) == i]
    array = _array(job, n)
    if array.complete(i) is not None:
        say(f"kvbatch: shard {i} of {n} is complete ({array.marker(i)}); nothing to generate")
    else:
        w = job.cfg.worker  # parts named after the shard: a shard reads only its own, and who made a row shows
        wid = f"{shards.worker_prefix(i)}{w.id or new_worker_id(job.host)}"
        me = replace(job, cfg=replace(job.cfg, worker=replace(w, id=wid)))
        with shards.local_queue(f"shard{i}") as q:
            describe_job(me, q)
            q.enqueue(rows)
            kept = array.load_checkpoints(i, q)
            reconcile(me.out_dir, q, shards.parts_of(i))  # what the shard's parts already hold is done
            c = q.counts()
            say(f"kvbatch: shard {i} of {n}: {len(rows)} rows, {c['done'] + c['error']} already in parts, "
                f"{kept} continue from checkpoints")
            work(me, q, after_checkpoint=lambda: array.save_checkpoints(i, q), parts=shards.parts_of(i))
            c = q.counts()
            if not c["pending"] + c["leased"]:
                array.mark_complete(i, c)
                say(f"kvbatch: shard {i} of {n} is complete")
    left = [s for s in range(n) if array.complete(s) is None]
    if job.cfg.action != "run":
        return None
    if left:
        say(f"kvbatch: {n - len(left)} of {n} shards are complete; the last to finish writes results.parquet "
            f"(or action=finalize)")
        return None
    return finalize_shards(job, n)


def finalize_shards(job: Job, n: int) -> Path:
    """results.parquet and summary.json from every shard's parts (rows not finished yet are left out and
    named); nothing is rewritten when the parts did not change since it was last written."""
    if not job.out_dir.is_dir():
        raise ConfigError(f"action={job.cfg.action}: no shard has run in {job.out_dir} yet; run the shards first "
                          f"(queue.shards={n} worker.shard=0 to {n - 1}, or a Slurm array)")
    job_identity.claim(job.out_dir, job.queue_job)
    array = shards.Array(job.out_dir, n, job.queue_job)
    rows = queue_rows(job)
    # the job's config, not one shard's worker (results.parquet's metadata: the same whoever merges)
    job = replace(job, cfg=replace(job.cfg, worker=replace(job.cfg.worker, shard=None, id=None)))
    # a fixed clock: the merge's queue is built afresh each time, and equal timestamps let finalize see
    # that nothing changed since results.parquet was written
    with shards.local_queue("finalize", clock=lambda: 0.0) as q:
        describe_job(job, q)
        q.enqueue(rows)
        if not (job.out_dir / passthrough.FILE).exists():
            carry_columns(job, rows)
        reconcile(job.out_dir, q)
        left = [i for i in range(n) if array.complete(i) is None]
        # the merge's queue holds no shard's checkpoints: the K/V files of shards not complete stay theirs
        fin, s = finish(job, q, None, prune_kv=not left)
    if left:
        say(f"kvbatch: {n - len(left)} of {n} shards are complete (not: {_some([str(i) for i in left])}); "
            f"results.parquet holds the {fin.rows} rows finished so far")
    out.info(summ.one_line(s))
    out.info(fin.path)
    if not left:
        check_rows(job.cfg, s)
    return fin.path
