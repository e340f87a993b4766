"""The config schema (Hydra structured configs) and the checks Hydra's types cannot express.

The schema is registered in Hydra's ConfigStore as `kvbatch_schema`; conf/config.yaml
puts it first in its defaults list, so every group option and every command-line
override is merged into typed dataclasses: an unknown key or a wrong type fails at
composition. `validate()` then checks values (ranges, sizes, enums) and raises
`ConfigError` with one line that names the key.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.memory import parse_size
from kvbatch.engine.models.config import ModelConfig

ACTIONS = ("run", "enqueue", "work", "status", "finalize", "report")
FORMATS = ("auto", "jsonl", "csv", "parquet")
KV_BITS = {"none": None, "q8": 8, "q4": 4}
MODEL_SOURCES = ("smollm2", "local", "tiny")


class ConfigError(KvbatchConfigError):
    """A bad key or value, or an unusable input: reported as one line before the model loads."""


@dataclass
class KVConfig:
    mode: str = "none"  # none | q8 | q4
    bits: Optional[int] = None  # must agree with mode (q8 -> 8, q4 -> 4, none -> null)
    group_size: int = 64
    page_size: int = 64
    allow_unvalidated: bool = False


@dataclass
class MemoryConfig:
    budget: str = "auto"  # "auto" or a size such as 8GiB (weights included)
    fraction: float = 0.8  # auto: share of the memory the machine can give now
    headroom: str = "1GiB"  # auto: kept free for everything else


@dataclass
class JobConfig:
    name: str = "sample"
    input: str = "jobs/sample_prompts.jsonl"  # relative: to the working dir, else to the project root
    format: str = "auto"  # auto (from the suffix) | jsonl | csv | parquet
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    id_column: str = "id"
    chat_template: bool = True  # wrap a prompt as one user message and apply the model's template
    max_tokens: int = 256
    max_prompt_tokens: Optional[int] = None  # None: the model's context length
    stop: List[str] = field(default_factory=list)


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0


@dataclass
class EngineSection:
    max_batch: int = 8
    prefill_chunk: int = 512


@dataclass
class OutputConfig:
    root: str = "outputs"
    dir: Optional[str] = None  # None: <root>/<job.name>/<config hash>
    progress: str = "auto"  # auto (a bar when stderr is a terminal) | on | off


@dataclass
class WorkerConfig:
    id: Optional[str] = None  # None: <host>-<pid>-<random>
    lease_s: float = 600.0  # a claimed row returns to the queue this long after its last renewal
    max_attempts: int = 3  # internal_error rows are retried up to this many attempts
    isolate_after: int = 3  # a row in flight when a worker died this many times runs alone ...
    max_crashes: int = 6  # ... and at this many it ends with internal_error (crashes are not attempts)
    prefetch: int = 4  # rows claimed beyond engine.max_batch, so the batch never starves
    flush_rows: int = 16  # write a part after this many finished rows ...
    flush_s: float = 30.0  # ... or this many seconds
    deadline: Optional[str] = None  # "07:00" (time of day) or "6h", "90m", "30s": stop claiming then


@dataclass
class DebugConfig:
    inject_nonfinite: Optional[str] = None  # "ROW_KEY:STEP": poison that row's logits at that step (tests)


@dataclass
class ReportConfig:
    sweep_dirs: List[str] = field(default_factory=list)  # action=report: sweep folders (globs allowed)
    out: Optional[str] = None  # where sweep.parquet/report.md go; default: the one sweep folder


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    job: JobConfig = field(default_factory=JobConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineSection = field(default_factory=EngineSection)
    output: OutputConfig = field(default_factory=OutputConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    action: str = "run"


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="kvbatch_schema", node=Config)


def _need(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _size(key: str, value: str, allow_auto: bool = False) -> None:
    if allow_auto and str(value).strip().lower() == "auto":
        return
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}={value!r}: {exc}{' or auto' if allow_auto else ''}") from None
    _need(n > 0 or key != "memory.budget", key, value, "must be > 0")


def parse_injection(text: Optional[str]) -> Optional[tuple[str, int]]:
    """'row-7:3' -> ('row-7', 3). The step is after the last ':' (row keys may hold ':')."""
    if text is None:
        return None
    key, sep, step = str(text).rpartition(":")
    if not sep or not key or not step.isdigit():
        raise ConfigError(f"debug.inject_nonfinite={text!r}: use ROW_KEY:STEP (STEP an integer >= 0)")
    return key, int(step)


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def check_deadline(text: Optional[str]) -> None:
    if text is None:
        return
    t = str(text).strip()
    ok = re.fullmatch(r"([01]?\d|2[0-3]):[0-5]\d", t) or (t and _DURATION.match(t))
    _need(bool(ok), "worker.deadline", text, "use a time of day like 07:00 or a duration like 6h, 90m, 1h30m")


def validate(cfg: Config) -> None:
    """Check every value Hydra's types let through; raise ConfigError naming the first bad key."""
    m, kv, mem, job, s, e, w = cfg.model, cfg.kv, cfg.memory, cfg.job, cfg.sampling, cfg.engine, cfg.worker
    _need(cfg.action in ACTIONS, "action", cfg.action, f"choose one of {', '.join(ACTIONS)}")
    _need(m.source in MODEL_SOURCES, "model.source", m.source, f"choose one of {', '.join(MODEL_SOURCES)}")
    _need(m.source != "local" or bool(m.path), "model.path", m.path,
          "model=local needs model.path (an mlx-lm directory or a Hugging Face repo id)")
    _need(kv.mode in KV_BITS, "kv.mode", kv.mode, "choose one of none, q8, q4")
    _need(kv.bits in (None, KV_BITS[kv.mode]), "kv.bits", kv.bits,
          f"does not match kv.mode={kv.mode} (expects {KV_BITS[kv.mode]})")
    _need(kv.group_size in (32, 64, 128), "kv.group_size", kv.group_size, "choose one of 32, 64, 128")
    _need(kv.page_size >= 1, "kv.page_size", kv.page_size, "must be >= 1")
    _size("memory.budget", mem.budget, allow_auto=True)
    _need(0 < mem.fraction <= 1, "memory.fraction", mem.fraction, "must be in (0, 1]")
    _size("memory.headroom", mem.headroom)
    _need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", job.name or "")), "job.name", job.name,
          "use letters, digits, '_', '-', '.' (it names the output folder)")
    _need(bool(job.input), "job.input", job.input, "must name an input file")
    _need(job.format in FORMATS, "job.format", job.format, f"choose one of {', '.join(FORMATS)}")
    _need(job.max_tokens >= 1, "job.max_tokens", job.max_tokens, "must be >= 1")
    _need(job.max_prompt_tokens is None or job.max_prompt_tokens >= 1, "job.max_prompt_tokens",
          job.max_prompt_tokens, "must be >= 1 or null")
    _need(all(isinstance(x, str) and x for x in job.stop), "job.stop", job.stop, "must be non-empty strings")
    _need(s.temperature >= 0, "sampling.temperature", s.temperature, "must be >= 0 (0 = greedy)")
    _need(0 < s.top_p <= 1, "sampling.top_p", s.top_p, "must be in (0, 1]")
    _need(s.top_k >= 0, "sampling.top_k", s.top_k, "must be >= 0 (0 = off)")
    _need(s.seed >= 0, "sampling.seed", s.seed, "must be >= 0")
    _need(e.max_batch >= 1, "engine.max_batch", e.max_batch, "must be >= 1")
    _need(e.prefill_chunk >= 1, "engine.prefill_chunk", e.prefill_chunk, "must be >= 1")
    _need(cfg.output.progress in ("auto", "on", "off"), "output.progress", cfg.output.progress,
          "choose one of auto, on, off")
    _need(w.lease_s > 0, "worker.lease_s", w.lease_s, "must be > 0")
    _need(w.max_attempts >= 1, "worker.max_attempts", w.max_attempts, "must be >= 1")
    _need(w.isolate_after >= 1, "worker.isolate_after", w.isolate_after, "must be >= 1")
    _need(w.max_crashes > w.isolate_after, "worker.max_crashes", w.max_crashes,
          f"must be > worker.isolate_after ({w.isolate_after}): a suspect row runs alone before it is given up")
    _need(w.prefetch >= 0, "worker.prefetch", w.prefetch, "must be >= 0")
    _need(w.flush_rows >= 1, "worker.flush_rows", w.flush_rows, "must be >= 1")
    _need(w.flush_s >= 0, "worker.flush_s", w.flush_s, "must be >= 0")
    check_deadline(w.deadline)
    parse_injection(cfg.debug.inject_nonfinite)
    _need(cfg.action != "report" or bool(cfg.report.sweep_dirs), "report.sweep_dirs", cfg.report.sweep_dirs,
          "action=report needs report.sweep_dirs=[DIR,...] (sweep folders)")


def to_config(node: Any) -> Config:
    """A composed DictConfig -> a validated Config dataclass tree."""
    cfg = OmegaConf.to_object(node) if not isinstance(node, Config) else node
    validate(cfg)
    return cfg


def as_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


# Sections that change what a row's result is; engine/memory/worker/output settings do not.
_HASHED = ("model", "kv", "job", "sampling", "debug")


def config_hash(cfg: Config, input_path: str) -> str:
    """Stable 12-hex id of everything that shapes the results: names the default output dir."""
    d = as_dict(cfg)
    keyed = {k: d[k] for k in _HASHED}
    keyed["job"] = {**keyed["job"], "input": input_path, "name": None}
    for k in ("cache_dir",):
        keyed["model"].pop(k, None)
    blob = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
