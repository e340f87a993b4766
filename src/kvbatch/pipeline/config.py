"""The config schema (Hydra structured configs) and the checks Hydra's types cannot express.

The schema is registered in Hydra's ConfigStore as `kvbatch_schema`; conf/config.yaml
puts it first in its defaults list, so every group option and every command-line
override is merged into typed dataclasses: an unknown key or a wrong type fails at
composition. `validate()` then checks values (ranges, sizes, enums) and raises
`ConfigError` with one line that names the key.

The `kv`, `memory` and `engine` sections are the engine's own dataclasses
(engine/config.py), so their values reach the engine as typed here and their checks
live there, once; this module checks only the pipeline's sections.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, List, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kvbatch.engine.config import EngineConfig, EngineSettings, KVConfig, MemoryConfig, SpeculativeConfig
from kvbatch.engine import reasoning
from kvbatch.engine.errors import ERROR_CODES, KvbatchConfigError
from kvbatch.engine.models.config import ADAPTER_NAME, ModelConfig
from kvbatch.pipeline import durations, extras, model_defaults, response_format, row_params
from kvbatch.pipeline.escapes import unescape
from kvbatch.pipeline.redact import redact, redact_config

ACTIONS = ("run", "enqueue", "work", "status", "finalize", "retry", "report", "score")
SHAPES = ("columns", "sharegpt", "alpaca")  # job.shape (pipeline/formats/shapes.py)
FORMATS = ("auto", "jsonl", "csv", "parquet", "openai_batch")
MODEL_SOURCES = ("smollm2", "local", "tiny")
# model.* keys only the tiny random model reads (its geometry and weights' seed)
TINY_ONLY = ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
             "vocab_size", "context_length", "seed")
# apply_chat_template's own arguments: set by kvbatch, never by job.chat_template_kwargs
MIN_LEASE_S = 3.0  # worker.lease_s: the shortest lease that renewals every lease_s/3 keep alive
RESERVED_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                   "return_dict", "return_tensors", "padding", "truncation", "max_length", "chat_template")


class ConfigError(KvbatchConfigError):
    """A bad key or value, or an unusable input: reported as one line before the model loads."""


@dataclass
class JobConfig:
    """The job's input: its file and format, which columns hold the prompt, messages and row id, and the prompt's
    limits."""

    name: str = "sample"
    input: str = "jobs/sample_prompts.jsonl"  # relative: to the working dir, else to the project root
    # auto (from the suffix; an OpenAI batch file from its first line) | jsonl | csv | parquet | openai_batch
    format: str = "auto"
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    id_column: str = "id"
    shape: str = "columns"  # columns (prompt/messages) | sharegpt | alpaca: the dataset shapes mapped to them
    sharegpt_column: str = "conversations"  # shape=sharegpt: the list of {from, value} turns
    alpaca_instruction: str = "instruction"  # shape=alpaca: the instruction ...
    alpaca_input: Optional[str] = "input"  # ... and the optional input after it (null: none)
    chat_template: bool = True  # wrap a prompt as one user message and apply the model's template
    system_prompt: Optional[str] = None  # prompt rows: a system turn before the user turn (chat_template=true)
    chat_template_kwargs: Optional[Any] = None  # passed to the template: {enable_thinking: false}
    continue_final_message: bool = False  # a trailing assistant turn is continued, not followed by a new turn
    max_tokens: int = 256
    max_prompt_tokens: Optional[int] = None  # None: the model's context length
    stop: List[str] = field(default_factory=list)  # backslash escapes decoded: '\n' (backslash, n) is a newline
    stop_token_ids: List[int] = field(default_factory=list)  # a row ends at any of these tokens (not output)
    min_tokens: int = 0  # EOS and stop_token_ids masked, stop strings not checked, before this many tokens
    ignore_eos: bool = False  # EOS is an ordinary token: rows run to max_tokens or a stop
    # constrained output: json_object | regex:PATTERN | a JSON schema (inline mapping or a .json file) | null
    response_format: Optional[Any] = None
    # reasoning blocks apart from the answer: auto (the model's tags, when its chat template writes them and the
    # job applies it) | none | START,END (e.g. '<think>,</think>'); response_format then constrains the answer only
    reasoning: str = "auto"
    max_reasoning_tokens: Optional[int] = None  # the closing tag is forced after this many tokens of reasoning
    adapter: Optional[str] = None  # the rows' LoRA adapter: one of model.adapters (a row's `adapter` column wins)
    # action=score: the columns whose text is scored after the row's prompt (one result row per column)
    score_columns: List[str] = field(default_factory=lambda: ["completion"])
    score_tokens: bool = False  # action=score: also each completion token's log-probability (output_logprobs)


@dataclass
class SamplingConfig:
    """The job's default sampling parameters (a row may override them in its own columns)."""

    temperature: Optional[float] = None  # 0 = greedy (kvbatch's default); null: sampling.defaults decides
    top_p: Optional[float] = None  # kvbatch's default 1 (off)
    top_k: Optional[int] = None  # 0 = off (kvbatch's default)
    seed: int = 0  # a row without its own seed samples with one derived from this and its row key
    n: int = 1  # samples per row: results get one row per (row, sample); the prompt is prefilled once
    min_p: Optional[float] = None  # 0 = off; drop tokens below min_p x the top token's probability
    # 1 = off; > 1 discourages every token of the prompt and the output so far
    repetition_penalty: Optional[float] = None
    presence_penalty: float = 0.0  # [-2, 2]; subtracted once from each token already output
    frequency_penalty: float = 0.0  # [-2, 2]; subtracted once per time a token was output
    logprobs: int = 0  # 0 = off; K: each output token's log-probability and the top K alternatives
    prompt_logprobs: bool = False  # the log-probability of every prompt token after the first
    # model: values the config leaves unset (null) come from the model's generation_config.json, then
    # kvbatch's defaults (as vLLM) | kvbatch: kvbatch's defaults (pipeline/model_defaults.py)
    defaults: str = "model"


@dataclass
class OutputConfig:
    """Where results go and how the run reports progress and failure."""

    root: str = "outputs"
    dir: Optional[str] = None  # None: <root>/<job.name>/<config hash>
    progress: str = "auto"  # auto (a bar on a terminal, else plain lines) | on (a bar) | off
    progress_every: str = "5m"  # progress=auto and stderr not a terminal: a plain progress line this often
    # exit 1 after writing the results when more than this share of the rows has an error code;
    # None: only when no row succeeded
    max_error_fraction: Optional[float] = None
    openai_batch: bool = False  # also write batch_output.jsonl (the OpenAI Batch API's output) beside results.parquet


@dataclass
class CheckpointEvery:
    """How often a worker checkpoints its rows in flight into the queue (pipeline/checkpoints.py), besides at
    every stop (deadline, Ctrl-C, SIGTERM); a kill -9 loses at most the tokens since the last one."""

    seconds: float = 60.0  # every running row this often (0: not by time)
    tokens: int = 0  # a row once it has this many tokens more than at its last checkpoint (0: not by tokens)


@dataclass
class WorkerConfig:
    """How a worker claims, leases, retries and writes rows, and when it stops."""

    id: Optional[str] = None  # None: <host>-<pid>-<random>
    lease_s: float = 600.0  # a claimed row returns to the queue this long after its last renewal
    max_attempts: int = 3  # internal_error rows are retried up to this many attempts
    isolate_after: int = 3  # a row in flight when a worker died this many times runs alone ...
    max_crashes: int = 6  # ... and at this many it ends with internal_error (crashes are not attempts)
    prefetch: int = 4  # rows claimed beyond engine.max_batch, so the batch never starves
    flush_rows: int = 16  # write a part after this many finished rows ...
    flush_s: float = 30.0  # ... or this many seconds
    deadline: Optional[str] = None  # "07:00" (time of day) or "6h", "90m", "30s": stop claiming then
    # this machine's name in the queue (None: its hostname): workers of one host judge each other by PID,
    # workers of other hosts by lease; set it where machines (containers) share a hostname
    host: Optional[str] = None
    replica: int = 0  # which of N identical workers this is (a launcher's sweep over worker.replica=range(N))
    # worker processes this command runs on this machine, on the job's one queue, each with 1/N of the memory
    # budget: N > 1 pays where one process leaves the device idle between steps (a small model on a GPU)
    processes: int = 1
    # queue.shards=N: which shard this worker generates (0 to N-1); None: Slurm's SLURM_ARRAY_TASK_ID
    shard: Optional[int] = None
    checkpoint_every: CheckpointEvery = field(default_factory=CheckpointEvery)
    # at a stop (deadline, first Ctrl-C/SIGTERM), also keep each checkpointed row's full K/V pages in the job's
    # kv/: it then continues without prefilling its kept tokens again (pipeline/kept_kv.py)
    keep_kv: bool = True


@dataclass
class QueueConfig:
    """Which queue the job's rows go through: SQLite in the output folder, or a shared PostgreSQL database."""

    # "" (default): queue.sqlite in the output folder (one machine); postgresql://user@host:port/db: a
    # PostgreSQL queue that workers on many hosts share (the output folder then on a shared file system).
    # Keep its password out of it: PGPASSWORD or ~/.pgpass (libpq reads them), queue.url_file, or
    # queue.url='${oc.env:VAR}'; kvbatch never writes a password into a file or a message anyway
    url: str = ""
    url_file: Optional[str] = None  # a file whose first line is queue.url (read at start, never stored)
    # N > 0: no shared queue at all; the rows are split into N shards by row key, each generated by its own
    # worker (worker.shard, or a Slurm array task) into the shared output folder (pipeline/shards.py)
    shards: int = 0


@dataclass
class DebugConfig:
    """Test-only fault injection."""

    inject_nonfinite: Optional[str] = None  # "ROW_KEY:STEP": poison that row's logits at that step (tests)
    # N: worker.deadline counts as reached once N rows have a result in this run (tests: a deadline
    # at an exact place, whatever the machine's speed)
    deadline_after_rows: Optional[int] = None
    # N: likewise once this run's engine generated N tokens (tests: a stop mid-row, rows' tokens kept)
    deadline_after_tokens: Optional[int] = None
    # N: every forward pass after the first N fails as a device that stops evaluating would (tests: the run
    # stops with its rows handed back uncharged, as after CUDA's "illegal memory access")
    device_fault_after: Optional[int] = None
    # N: the run's N-th forward pass fails when evaluated, its cache writes holding the failed graph (tests: the
    # rows in flight retry in a new engine and the run completes)
    eval_fault_at: Optional[int] = None


@dataclass
class ReportConfig:
    """action=report: which sweep folders to report on and where the report goes."""

    sweep_dirs: List[str] = field(default_factory=list)  # action=report: sweep folders (globs allowed)
    out: Optional[str] = None  # where sweep.parquet/report.md go; default: the one sweep folder
    teacher_forced: bool = True  # the sweep report scores quantized jobs on their kv=none partner's outputs


@dataclass
class RetryConfig:
    """action=retry: which error rows go back to the queue."""

    # action=retry: requeue error rows with these codes; []: every code but invalid_input
    codes: List[str] = field(default_factory=list)


@dataclass
class Config:
    """The whole kvbatch config (Hydra's schema): every section and the action to run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    job: JobConfig = field(default_factory=JobConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineSettings = field(default_factory=EngineSettings)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    action: str = "run"


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="kvbatch_schema", node=Config)


def _need(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _short(value: Any) -> str:
    text = repr(OmegaConf.to_container(value) if hasattr(value, "items") and not isinstance(value, dict) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_injection(text: Optional[str]) -> Optional[tuple[str, int]]:
    """'row-7:3' -> ('row-7', 3). The step is after the last ':' (row keys may hold ':')."""
    if text is None:
        return None
    key, sep, step = str(text).rpartition(":")
    if not sep or not key or not step.isdigit():
        raise ConfigError(f"debug.inject_nonfinite={text!r}: use ROW_KEY:STEP (STEP an integer >= 0)")
    return key, int(step)


def engine_config(cfg: Config) -> EngineConfig:
    """The engine's config: the schema's own sections, not copies (checked by EngineConfig.check)."""
    return EngineConfig(kv=cfg.kv, memory=cfg.memory, engine=cfg.engine, speculative=cfg.speculative,
                        max_prompt_tokens=cfg.job.max_prompt_tokens)


def validate(cfg: Config) -> None:
    """Check every value Hydra's types let through; raise ConfigError naming the first bad key."""
    m, job, w = cfg.model, cfg.job, cfg.worker
    _need(cfg.action in ACTIONS, "action", cfg.action, f"choose one of {', '.join(ACTIONS)}")
    _need(m.source in MODEL_SOURCES, "model.source", m.source, f"choose one of {', '.join(MODEL_SOURCES)}")
    _need(m.source != "local" or bool(m.path), "model.path", m.path,
          "model=local needs model.path (an mlx-lm directory or a Hugging Face repo id)")
    _need(not (m.adapter_path and m.adapters), "model.adapter_path", m.adapter_path,
          "set model.adapter_path (one adapter for every row) or model.adapters (rows pick one by name), not both")
    ad = m.adapters
    _need(ad is None or (isinstance(ad, dict) and all(isinstance(v, str) for v in ad.values())), "model.adapters",
          ad, "must be a mapping of adapter names to adapter folders, e.g. {math: adapters/math}")
    bad_names = [n for n in (ad or {}) if not ADAPTER_NAME.fullmatch(str(n))]
    _need(not bad_names, "model.adapters", bad_names, "adapter names are letters, digits, '_', '-', '.'")
    _need(job.adapter is None or job.adapter in (m.adapters or {}), "job.adapter", job.adapter,
          f"must name one of model.adapters ({', '.join(m.adapters or {}) or 'none set'})")
    if m.source != "tiny":  # the random model's geometry: any other model has its own
        base = ModelConfig()
        for key in TINY_ONLY:
            _need(getattr(m, key) == getattr(base, key), f"model.{key}", getattr(m, key),
                  f"only model=tiny uses it (model={m.source} has its own; remove it)")
    d = cfg.speculative.model
    for key in ("adapter_path", "adapters"):  # a draft proposes for every row: one set of weights
        _need(not getattr(d, key), f"speculative.model.{key}", getattr(d, key),
              "a draft model runs without LoRA adapters; remove it")
    if cfg.speculative.method == "draft":
        _need(d.source in MODEL_SOURCES, "speculative.model.source", d.source,
              f"choose one of {', '.join(MODEL_SOURCES)}")
        _need(d.source != "local" or bool(d.path), "speculative.model.path", d.path,
              "speculative.model.source=local needs speculative.model.path (an mlx-lm directory or a Hugging Face "
              "repo id)")
    try:
        engine_config(cfg).check()  # kv.*, memory.*, engine.*, job.max_prompt_tokens
    except KvbatchConfigError as exc:
        raise ConfigError(str(exc)) from None
    _need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", job.name or "")) and job.name not in (".", ".."), "job.name",
          job.name, "use letters, digits, '_', '-', '.' and not '.' or '..' alone (it names one output folder)")
    _need(bool(job.input), "job.input", job.input, "must name an input file")
    _need(job.format in FORMATS, "job.format", job.format, f"choose one of {', '.join(FORMATS)}")
    _need(job.shape in SHAPES, "job.shape", job.shape, f"choose one of {', '.join(SHAPES)}")
    bad = row_params.config_problem(cfg)  # the per-row parameters' job values (engine/params.py)
    if bad:
        raise ConfigError(f"{bad[0]}={bad[1]!r}: {bad[2]}")
    _need(cfg.sampling.n == 1 or (cfg.sampling.temperature or 0.0) > 0, "sampling.n", cfg.sampling.n,
          f"with sampling.temperature=0 (greedy) gives {cfg.sampling.n} identical samples: set "
          f"sampling.temperature > 0 (or sampling.n=1)")
    _need(job.system_prompt is None or job.chat_template, "job.system_prompt", job.system_prompt,
          "needs job.chat_template=true (a system turn exists only in a chat template)")
    kw = job.chat_template_kwargs
    _need(kw is None or (isinstance(kw, dict) and all(isinstance(k, str) for k in kw)), "job.chat_template_kwargs",
          kw, "must be a mapping of argument names to values, e.g. {enable_thinking: false}")
    _need(not kw or job.chat_template, "job.chat_template_kwargs", kw, "needs job.chat_template=true")
    taken = sorted(set(kw or ()) & set(RESERVED_KWARGS))
    _need(not taken, "job.chat_template_kwargs", job.chat_template_kwargs,
          f"{', '.join(taken)} is set by kvbatch (use job.continue_final_message, job.chat_template)")
    _need(not job.continue_final_message or job.chat_template, "job.continue_final_message",
          job.continue_final_message, "needs job.chat_template=true")
    _need(job.min_tokens <= job.max_tokens, "job.min_tokens", job.min_tokens,
          f"must be <= job.max_tokens ({job.max_tokens})")
    _need(reasoning.spec_problem(job.reasoning) is None, "job.reasoning", job.reasoning,
          str(reasoning.spec_problem(job.reasoning)))
    mrt = job.max_reasoning_tokens
    _need(mrt is None or 0 <= mrt < job.max_tokens, "job.max_reasoning_tokens", mrt,
          f"must be >= 0 and below job.max_tokens ({job.max_tokens}), so the answer has room (or null: no limit)")
    _need(mrt is None or job.reasoning != "none", "job.max_reasoning_tokens", mrt,
          "needs reasoning tags: job.reasoning=auto or START,END, not none")
    try:
        response_format.resolve(job.response_format)
    except ValueError as exc:
        raise ConfigError(f"job.response_format={_short(job.response_format)}: {exc}") from None
    _need(cfg.output.progress in ("auto", "on", "off"), "output.progress", cfg.output.progress,
          "choose one of auto, on, off")
    try:
        durations.seconds(cfg.output.progress_every)
    except ValueError as exc:
        raise ConfigError(f"output.progress_every={cfg.output.progress_every!r}: {exc}") from None
    mef = cfg.output.max_error_fraction
    _need(mef is None or 0 <= mef <= 1, "output.max_error_fraction", mef,
          "must be in [0, 1] (0: any error row fails the run) or null (fail only when no row succeeded)")
    _need(w.lease_s >= MIN_LEASE_S, "worker.lease_s", w.lease_s,
          f"must be >= {MIN_LEASE_S:g} (a worker renews its leases every lease_s/3: a shorter lease runs out "
          f"between renewals and every row would be taken from a live worker)")
    _need(w.max_attempts >= 1, "worker.max_attempts", w.max_attempts, "must be >= 1")
    _need(w.isolate_after >= 1, "worker.isolate_after", w.isolate_after, "must be >= 1")
    _need(w.max_crashes > w.isolate_after, "worker.max_crashes", w.max_crashes,
          f"must be > worker.isolate_after ({w.isolate_after}): a suspect row runs alone before it is given up")
    _need(w.prefetch >= 0, "worker.prefetch", w.prefetch, "must be >= 0")
    _need(w.flush_rows >= 1, "worker.flush_rows", w.flush_rows, "must be >= 1")
    _need(w.flush_s >= 0, "worker.flush_s", w.flush_s, "must be >= 0")
    try:
        durations.deadline_at(w.deadline)
    except ValueError as exc:
        raise ConfigError(f"worker.deadline={w.deadline!r}: {exc}") from None
    _need(w.host is None or (bool(re.fullmatch(r"[A-Za-z0-9_.-]+", w.host)) and w.host not in (".", "..")),
          "worker.host", w.host,
          "use letters, digits, '_', '-', '.' (it names the worker and its parts)")
    _need(w.replica >= 0, "worker.replica", w.replica, "must be >= 0")
    _need(w.processes >= 1, "worker.processes", w.processes, "must be >= 1")
    _need(w.processes == 1 or not cfg.queue.shards, "worker.processes", w.processes,
          f"a sharded job (queue.shards={cfg.queue.shards}) runs one process a shard: run more shards instead")
    ce = w.checkpoint_every
    _need(ce.seconds >= 0, "worker.checkpoint_every.seconds", ce.seconds, "must be >= 0 (0: not by time)")
    _need(ce.tokens >= 0, "worker.checkpoint_every.tokens", ce.tokens, "must be >= 0 (0: not by tokens)")
    url = cfg.queue.url or ""
    if cfg.queue.url_file is not None:
        _need(not url, "queue.url_file", cfg.queue.url_file, "set queue.url or queue.url_file, not both")
        url = cfg.queue.url = read_url_file(cfg.queue.url_file)
    _need(not url or bool(re.match(r"postgres(ql)?://", url)), "queue.url", redact(url),
          "use postgresql://user@host:port/database, or leave it empty for queue.sqlite in the output folder")
    _need(not url or extras.missing("postgres") is None, "queue.url", redact(url), str(extras.missing("postgres")))
    _need(cfg.action != "report" or extras.missing("sweep") is None, "action", cfg.action,
          str(extras.missing("sweep")))
    _need(cfg.queue.shards >= 0, "queue.shards", cfg.queue.shards, "must be >= 0 (0: not sharded)")
    _need(not cfg.queue.shards or not url, "queue.shards", cfg.queue.shards,
          "a sharded job needs no queue server: leave queue.url empty (or queue.shards=0 to use the database)")
    _need(w.shard is None or (cfg.queue.shards > 0 and 0 <= w.shard < cfg.queue.shards), "worker.shard", w.shard,
          f"must be 0 to {cfg.queue.shards - 1} (queue.shards={cfg.queue.shards})" if cfg.queue.shards
          else "needs queue.shards=N (the number of shards the job is split into)")
    parse_injection(cfg.debug.inject_nonfinite)
    after = cfg.debug.deadline_after_rows
    _need(after is None or after >= 1, "debug.deadline_after_rows", after, "must be >= 1 (or null)")
    after = cfg.debug.deadline_after_tokens
    _need(after is None or after >= 1, "debug.deadline_after_tokens", after, "must be >= 1 (or null)")
    _need(all(c in ERROR_CODES for c in cfg.retry.codes), "retry.codes", cfg.retry.codes,
          f"choose among {', '.join(ERROR_CODES)} ([] = every code but invalid_input)")
    _need(cfg.action != "report" or bool(cfg.report.sweep_dirs), "report.sweep_dirs", cfg.report.sweep_dirs,
          "action=report needs report.sweep_dirs=[DIR,...] (sweep folders)")
    score_problem(cfg)


SCORE_KEYS = ("score_columns", "score_tokens")  # job.* keys only action=score reads


def score_problem(cfg: Config) -> None:
    """action=score's own settings (job.score_columns, and what scoring given text cannot honour)."""
    from kvbatch.engine.params import MAX_SAMPLES

    job, cols = cfg.job, list(cfg.job.score_columns)
    _need(all(isinstance(c, str) and c.strip() for c in cols) and len(set(cols)) == len(cols), "job.score_columns",
          cols, "must be distinct, non-empty column names, e.g. [chosen, rejected]")
    if cfg.action != "score":
        return
    _need(0 < len(cols) <= MAX_SAMPLES, "job.score_columns", cols,
          f"action=score needs 1 to {MAX_SAMPLES} columns to score, e.g. [completion] or [chosen, rejected]")
    used = {job.prompt_column, job.messages_column, job.id_column} & set(cols)
    _need(not used, "job.score_columns", cols,
          f"{', '.join(sorted(used))} is the row's prompt, messages or id column, not a completion")
    ignored = {"sampling.n": (cfg.sampling.n, 1), "sampling.logprobs": (cfg.sampling.logprobs, 0),
               "sampling.prompt_logprobs": (cfg.sampling.prompt_logprobs, False),
               "job.response_format": (job.response_format, None),
               "output.openai_batch": (cfg.output.openai_batch, False)}
    for key, (value, off) in ignored.items():  # generation's settings: scoring given text would ignore them
        _need(value == off, key, value, f"action=score scores given text (nothing is generated): leave it "
              f"{json.dumps(off)} (job.score_tokens=true gives each completion token's log-probability)")


def read_url_file(path: str) -> str:
    """queue.url_file's URL: the first line of a regular file of at most 64 KiB (ConfigError otherwise)."""
    import os
    import stat

    try:
        p = os.path.expanduser(path)
        if not stat.S_ISREG(os.stat(p).st_mode):
            raise ConfigError(f"queue.url_file={path!r}: not a regular file")
        with open(p, "rb") as fh:
            data = fh.read(65537)
        if len(data) > 65536:
            raise ConfigError(f"queue.url_file={path!r}: larger than 64 KiB (it holds one URL)")
        lines = data.decode("utf-8-sig").strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"queue.url_file={path!r}: cannot read it ({type(exc).__name__})") from None
    return lines[0].strip() if lines else ""


def to_config(node: Any) -> Config:
    """A composed DictConfig -> a validated Config dataclass tree (job.stop's escapes decoded, once)."""
    if isinstance(node, Config):
        cfg = node
    else:
        cfg = cast(Config, OmegaConf.to_object(node))  # the schema's node: a Config
        cfg.job.stop = [unescape(x) if isinstance(x, str) else x for x in cfg.job.stop]
    _need(cfg.sampling.defaults in model_defaults.CHOICES, "sampling.defaults", cfg.sampling.defaults,
          f"choose one of {', '.join(model_defaults.CHOICES)}")
    model_defaults.fill(cfg.sampling, cfg.model)
    validate(cfg)
    return cfg


def as_dict(cfg: Config) -> dict:
    """The config as plain containers, interpolations resolved (for the hash; stored: as_stored)."""
    return cast(dict, OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


def as_stored(cfg: Config) -> dict:
    """The config as config.yaml, the queue, results' metadata and a sweep's files keep it: as_dict with
    queue.url's password hidden and queue.url_file's URL not copied into it."""
    d = redact_config(as_dict(cfg))
    if cfg.queue.url_file is not None:
        d["queue"]["url"] = ""
    return d


def stored_yaml(cfg: Config) -> str:
    """as_stored as YAML (config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.create(as_stored(cfg)))


# Sections that shape a row's result; memory/worker/output settings and engine sizes do not.
_SHAPES_OUTPUTS = ("model", "job", "sampling", "debug")


# Settings that cannot change a row's tokens while at their defaults: keyed only when set, so the
# folder of a job that leaves them alone keeps its name across kvbatch versions that add them.
_SAME_TOKENS_AT_DEFAULT = (("model", "adapter_path", None), ("model", "adapters", None), ("model", "adapters", {}),
                           ("job", "adapter", None), ("job", "max_reasoning_tokens", None))


def run_identity(cfg: Config, input_path: str, include_kv: bool) -> str:
    """12 hex digits naming what a run's outputs depend on: the model (not where it is cached),
    the job (its input by resolved path, not its name), sampling and debug settings; with
    `include_kv`, also the KV settings and the engine options that can change tokens
    (EngineOptions.identity). With it: the output folder's hash (runs that can differ never share
    a folder). Without it: the sweep's comparison key (jobs that differ only in KV or engine
    options are compared with each other)."""
    d = as_dict(cfg)
    keyed = {k: d[k] for k in _SHAPES_OUTPUTS}
    keyed["model"].pop("cache_dir", None)
    keyed["debug"].pop("deadline_after_rows", None)  # where a run stops, not what its rows hold
    keyed["debug"].pop("deadline_after_tokens", None)
    keyed["debug"].pop("device_fault_after", None)  # whether a run stops early, not what its rows hold
    keyed["debug"].pop("eval_fault_at", None)
    keyed["sampling"].pop("defaults", None)  # the values it chose are keyed themselves
    keyed["job"] = {**keyed["job"], "input": str(input_path), "name": None}
    for section, key, default in _SAME_TOKENS_AT_DEFAULT:
        if keyed[section].get(key, default) == default:
            keyed[section].pop(key, None)
    if cfg.job.response_format is None:  # reasoning only splits the text; with a schema it moves the grammar
        keyed["job"].pop("reasoning", None)
    adapters = {"": cfg.model.adapter_path} if cfg.model.adapter_path else dict(cfg.model.adapters or {})
    if adapters:  # an adapter by its files' content too: one retrained in the same folder is another job
        keyed["model"]["adapter_content"] = {k: adapter_digest(v) for k, v in adapters.items()}
    if cfg.action == "score":  # scores, not generated rows: a folder of its own
        keyed["task"] = "score"
    else:  # generation never reads them
        for k in SCORE_KEYS:
            keyed["job"].pop(k, None)
    if cfg.job.response_format is not None:  # a schema file by its content, not its path
        keyed["job"]["response_format"] = response_format.canonical(response_format.resolve(cfg.job.response_format))
    if include_kv:
        keyed["kv"] = asdict(cfg.kv)
        keyed["engine_options"] = cfg.engine.options.identity()
        if not cfg.engine.prefix_cache:  # it can change tokens (q8/q4: a cached prefix was read quantized)
            keyed["prefix_cache"] = False
        if cfg.speculative.method != "none":  # the verification pass's numerics can move a near-tie
            keyed["speculative"] = asdict(cfg.speculative)
            # which steps verify and how, and where the same proposals are looked up: not what the rows keep
            for key in ("adaptive", "split_pass_tokens", "ngram_search", "chain"):
                keyed["speculative"].pop(key)
            if cfg.speculative.method == "draft":
                keyed["speculative"]["model"].pop("cache_dir", None)
            else:
                del keyed["speculative"]["model"]
    blob = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def adapter_digest(folder: str) -> Optional[str]:
    """A digest of an adapter folder's two files (None: they cannot be read; loading it says why)."""
    from pathlib import Path

    h = hashlib.blake2b(digest_size=16)
    try:
        for name in ("adapter_config.json", "adapters.safetensors"):
            with open(Path(folder).expanduser() / name, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def config_hash(cfg: Config, input_path: str) -> str:
    """Names the default output folder (<root>/<job>/<hash>)."""
    return run_identity(cfg, input_path, include_kv=True)


def compare_key(cfg: Config, input_path: str) -> str:
    """Sweep jobs with equal keys saw the same model, prompts and sampling."""
    return run_identity(cfg, input_path, include_kv=False)
