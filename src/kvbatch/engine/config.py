"""The engine's typed configs, and their checks: the one place that decides what a valid setting is.

The Hydra schema (pipeline/config.py) embeds these dataclasses as its `kv`, `memory` and
`engine` sections, so a key set on the command line (`kv.page_size=16`,
`engine.options.lookahead=off`) reaches the engine as it is, typed, with no copy in between.
`check()` raises KvbatchConfigError with one line naming the key.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.sizes import parse_size

# The one KV-mode table: mode -> (key bits, value bits) of the stored K/V (None: the model's dtype).
# k8v4: keys carry attention's outlier channels and every score, values only average: keys at 8
# bits, values at 4 (llama.cpp's K8V4 costs ~+0.5% perplexity for 24% less cache than q8).
KV_BITS: dict[str, tuple[Optional[int], Optional[int]]] = {
    "none": (None, None), "q8": (8, 8), "q4": (4, 4), "k8v4": (8, 4)}
KV_MODES = tuple(KV_BITS)
QUANT_BITS = (4, 8)  # what kv.key_bits / kv.value_bits may set
GROUP_SIZES = (32, 64, 128)
ADMISSIONS = ("reserve", "optimistic")


@dataclass
class KVConfig:
    """How the KV cache stores keys and values (Hydra group `kv/`)."""

    mode: str = "none"  # none | q8 | q4 | k8v4
    group_size: int = 64  # quantization group: values along head_dim; keys too, or along tokens per channel
    page_size: int = 64  # tokens per KV page
    allow_unvalidated: bool = False  # run a KV mode that is not validated for this model/backend
    key_bits: Optional[int] = None  # 4 | 8: the keys' bits (null: the mode's)
    value_bits: Optional[int] = None  # 4 | 8: the values' bits (null: the mode's)
    # keys (and, at attention, queries) turned by one orthogonal matrix (a normalized Hadamard of
    # head_dim) before quantizing: scores are unchanged, no channel dominates a group's scale
    rotate_keys: bool = False
    # each row's first N tokens (attention sinks) also kept in full precision, read from there
    full_precision_tokens: int = 0

    @property
    def kv_bits(self) -> tuple[Optional[int], Optional[int]]:
        """(key bits, value bits): the mode's, unless kv.key_bits / kv.value_bits set them."""
        kb, vb = KV_BITS.get(self.mode, (None, None))
        return (self.key_bits or kb, self.value_bits or vb)

    @property
    def quantized(self) -> bool:
        """Whether the mode stores quantized pages (kv_bits set)."""
        return self.kv_bits[0] is not None

    @property
    def label(self) -> str:
        """The effective mode's name: the named mode with these bits (q8, q4, k8v4) or k<K>v<V>,
        then +rot and +fp<N> for the options that change what is stored."""
        kb, vb = self.kv_bits
        name = self.mode if KV_BITS.get(self.mode) == (kb, vb) else mode_name(kb, vb)
        return name + ("+rot" if self.rotate_keys else "") + \
            (f"+fp{self.full_precision_tokens}" if self.full_precision_tokens else "")


def mode_name(key_bits: Optional[int], value_bits: Optional[int]) -> str:
    """The KV mode named by its bits: a mode of KV_BITS, or k<K>v<V>."""
    for name, bits in KV_BITS.items():
        if bits == (key_bits, value_bits):
            return name
    return f"k{key_bits}v{value_bits}"


@dataclass
class MemoryConfig:
    """The memory budget (Hydra group `memory/`)."""

    budget: str = "auto"  # "auto" or a size such as 8GiB (weights included)
    fraction: float = 0.8  # auto: share of the memory the machine can give now
    headroom: str = "1GiB"  # auto: kept free for everything else
    # hold MLX's allocator to the budget too: its cache of freed buffers is given back to the device before the
    # process would pass the budget (processes sharing a device cannot use each other's cache; worker.processes
    # > 1 sets it)
    limit_allocator: bool = False

    @property
    def budget_bytes(self) -> Optional[int]:
        """The explicit budget in bytes; None for auto (resolved once the weights are loaded)."""
        return None if str(self.budget).strip().lower() == "auto" else parse_size(self.budget)


@dataclass
class CudaLaunch:
    """Launch settings of the fused CUDA decode kernels (routes/cuda_kernels.py). The defaults are
    the measured best (docs/performance.md); the other values exist for A/B runs."""

    chunk: int = 1024  # tokens per split of a long row (0: never split)
    unsplit: int = 1024  # rows up to this many tokens are not split
    unroll: int = 0  # tokens per lane per loop step; 0: the kernel kind's default (dense 2, q8/q4 4)
    warps: int = 0  # most warps per block; 0: the kernel kind's default (dense 8, q8/q4 4)
    kernel_writes: bool = True  # decode stores the step's new K/V inside the kernel (else scatters first)
    # bf16/fp16 dense decode and speculative verification windows on the tensor cores (mma.sync: a window's
    # pages read once for all its queries, with decode's numbers), else the decode-style kernel
    tensor_cores: bool = True
    # q8 decode of bf16/fp16 tails on the tensor cores (cuda_source.mma_quant_source), else the decode-style q8
    # kernel
    quant_tensor_cores: bool = True


# Options that never change a row's tokens (they change how fast, or what is printed): left out of
# a run's identity (`identity()`), so they do not move results to another output folder.
_SAME_OUTPUTS = frozenset({"lookahead", "step_reuse", "attention_trace", "attention_threads"})
_CHOICES = {"route": ("auto", "portable"), "lookahead": ("auto", "on", "off"),
            "attention_trace": ("off", "nonfinite", "all")}


@dataclass
class EngineOptions:
    """Behaviour switches of the engine (Hydra `engine.options.*`). Every one is recorded in
    summary.json; those that can change outputs are part of the run's identity."""

    # auto: the fastest route this backend has; portable: the route Apple's Metal backend takes
    # (pages gathered, MLX's SDPA / quantized_matmul; no CPU in-place reads, no CUDA kernels)
    route: str = "auto"
    # decode dispatches the next step before reading the previous step's tokens:
    # auto = on for GPU backends, off on the CPU (the CPU does both)
    lookahead: str = "auto"
    in_place: bool = True  # CPU kv none decode reads float32 pages in place (gather_mm), else gathers
    q_in_place: bool = True  # CPU q8/q4 decode reads packed pages in place (gather_qmm), else gathers
    rope_table: bool = True  # CPU decode RoPE from one cos/sin table per step (else MLX's kernel per call)
    cpu_swiglu: bool = True  # CPU SwiGLU MLPs take e^x by a compiled polynomial (else mlx-lm's swiglu: scalar exp)
    step_reuse: bool = True  # CUDA decode carries positions on the device and reuses an unchanged page table
    # passes of 2..multi_query tokens a row (speculative verification windows, short prompt tails) read
    # the pages as decode does, each query over the keys up to its own position (kv none; q8/q4 on the
    # CPU and the portable route when the window stays in the row's tail page); 1: the prefill path
    multi_query: int = 8
    # CPU decode attention spreads over this many streams (kv none: groups of rows; q8/q4: runs of
    # pages); 0: min(cores, 4); 1: off
    attention_threads: int = 0
    attention_trace: str = "off"  # off | nonfinite (log bad attention calls) | all (log every call)
    cuda: CudaLaunch = field(default_factory=CudaLaunch)

    def identity(self) -> dict[str, Any]:
        """The options that can change a row's tokens (part of the output folder's hash)."""
        return {k: v for k, v in asdict(self).items() if k not in _SAME_OUTPUTS}


@dataclass
class EngineSettings:
    """The `engine:` section: how many rows run together, how prompts are cut, and the options."""

    # rows that run together: "auto" (as many as memory admits, up to the backend's measured
    # ceiling, engine/batch_limits.py) or a number
    max_batch: Any = "auto"
    prefill_chunk: int = 512  # most prompt tokens of one row in one prefill pass
    # most tokens of one prefill pass, all its rows together (padding included): vLLM's
    # max_num_batched_tokens; "auto" = the backend's default (engine/batch_limits.py)
    prefill_tokens: Any = "auto"
    # reserve: a row is admitted only if its worst case (prompt + max_tokens) fits, and never stops;
    # optimistic: admitted when what it needs now fits; when growth cannot fit, the most recently
    # admitted rows are preempted (pages freed, tokens kept) and resume later
    admission: str = "optimistic"
    # automatic prefix caching: full pages of a prompt are cached by the hash of their tokens and
    # everything before them; a row whose prompt begins with cached pages takes them (engine/sharing.py)
    prefix_cache: bool = True
    options: EngineOptions = field(default_factory=EngineOptions)


SPEC_METHODS = ("none", "ngram", "draft")
NGRAM_SEARCHES = ("host", "device")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (the `speculative:` section, job level; engine/speculative/). A row's
    proposed tokens are checked by one verification pass with the batch, so outputs are those of
    decoding without it (greedy: the same tokens; sampled: the same distribution)."""

    # none | ngram (proposals from the row's own prompt and output) | draft (from a second, smaller model)
    method: str = "none"
    num_tokens: int = 4  # k: most tokens proposed for a row per step
    # draft: the draft model, named as `model` names the model (same tokenizer and vocabulary)
    model: ModelConfig = field(default_factory=ModelConfig)
    # ngram: the suffix of the row's tokens matched against its earlier tokens, longest first
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # ngram: where the rows' suffixes are looked up: host (an index per row, Python) | device (every
    # proposing row at once over its tokens kept on the device: engine/speculative/ngram_device.py)
    ngram_search: str = "host"
    # ngram_search=device with the lookahead: each verification pass built on the device from the unread pass
    # in flight, not after the host read it (engine/speculative/chain.py); the same tokens either way
    chain: bool = True
    # no proposals in a step with more decoding rows than this (vLLM's disable_by_batch_size): where a
    # batch already keeps the device's compute busy, verifying k more tokens a row costs about k steps
    disable_by_batch_size: Optional[int] = None
    # measure the output tokens a second of steps that verify proposals and of steps that do not, per
    # batch size, and propose only while verifying is at least as fast (engine/speculative/payoff.py)
    adaptive: bool = True
    # a verification pass runs the rows that proposed nothing as a separate one-token forward when that
    # saves at least this many padded window positions (those rows x (window - 1)); a second forward
    # reads the weights again, which costs a CPU about 45 positions' work, and on the H200 it never paid
    # (docs/decoding.md); 0: always; null: never (every row padded to the longest window)
    split_pass_tokens: Optional[int] = None


@dataclass
class EngineConfig:
    """Everything an Engine is built from besides the model."""

    kv: KVConfig = field(default_factory=KVConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    engine: EngineSettings = field(default_factory=EngineSettings)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    max_prompt_tokens: Optional[int] = None  # a limit below the model's context (prompt_too_long above it)
    # the most rows this engine will be given (a job's rows to run; None: unknown): batch slots and the
    # quantized modes' dense tail pages beyond them are never allocated
    rows: Optional[int] = None

    def check(self) -> None:
        """Raise KvbatchConfigError naming the first setting out of range (kv, memory, engine, speculative,
        max_prompt_tokens)."""
        check_kv(self.kv)
        check_memory(self.memory)
        check_settings(self.engine)
        check_speculative(self.speculative)
        sp, mq = self.speculative, self.engine.options.multi_query
        # a window wider than multi_query takes the prefill path, whose rounding differs from decode's, and
        # on bf16 models that changes greedy tokens (docs/decoding.md)
        _need(sp.method == "none" or sp.num_tokens + 1 <= mq, "speculative.num_tokens", sp.num_tokens,
              f"a verification window (num_tokens + 1 tokens) must fit engine.options.multi_query ({mq}) to be "
              "read as decode reads, so greedy tokens stay those without speculation; set "
              f"engine.options.multi_query={sp.num_tokens + 1} or lower speculative.num_tokens")
        _need(self.max_prompt_tokens is None or self.max_prompt_tokens >= 1, "job.max_prompt_tokens",
              self.max_prompt_tokens, "must be >= 1 or null")


def _need(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise KvbatchConfigError(f"{key}={value!r}: {why}")


def _size(key: str, value: Any, allow_auto: bool = False) -> None:
    if allow_auto and str(value).strip().lower() == "auto":
        return
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise KvbatchConfigError(f"{key}={value!r}: {exc}{' or auto' if allow_auto else ''}") from None
    _need(n > 0 or key != "memory.budget", key, value, "must be > 0")


def check_kv(kv: KVConfig) -> None:
    """Raise KvbatchConfigError when a kv.* setting is out of range or does not go with kv.mode."""
    _need(kv.mode in KV_BITS, "kv.mode", kv.mode, f"choose one of {', '.join(KV_MODES)}")
    quant = f"needs a quantized kv.mode ({', '.join(m for m in KV_MODES if m != 'none')})"
    for key in ("key_bits", "value_bits"):
        v = getattr(kv, key)
        _need(v is None or (not isinstance(v, bool) and v in QUANT_BITS), f"kv.{key}", v,
              f"choose one of {', '.join(map(str, QUANT_BITS))} or null")
        _need(v is None or kv.mode != "none", f"kv.{key}", v, quant)
    _need(not kv.rotate_keys or kv.mode != "none", "kv.rotate_keys", kv.rotate_keys, quant)
    n = kv.full_precision_tokens
    _need(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "kv.full_precision_tokens", n, "must be >= 0")
    _need(not n or kv.mode != "none", "kv.full_precision_tokens", n, quant)
    _need(kv.group_size in GROUP_SIZES, "kv.group_size", kv.group_size,
          f"choose one of {', '.join(map(str, GROUP_SIZES))}")
    _need(kv.page_size >= 1, "kv.page_size", kv.page_size, "must be >= 1")


def check_memory(mem: MemoryConfig) -> None:
    """Raise KvbatchConfigError when a memory.* setting (budget, fraction, headroom) is out of range."""
    _size("memory.budget", mem.budget, allow_auto=True)
    _need(0 < mem.fraction <= 1, "memory.fraction", mem.fraction, "must be in (0, 1]")
    _size("memory.headroom", mem.headroom)


def check_speculative(sp: SpeculativeConfig) -> None:
    """Raise KvbatchConfigError when a speculative.* setting is out of range."""
    _need(sp.method in SPEC_METHODS, "speculative.method", sp.method, f"choose one of {', '.join(SPEC_METHODS)}")
    _need(1 <= sp.num_tokens <= 64, "speculative.num_tokens", sp.num_tokens, "must be in [1, 64]")
    _need(sp.prompt_lookup_min >= 1, "speculative.prompt_lookup_min", sp.prompt_lookup_min, "must be >= 1")
    _need(sp.ngram_search in NGRAM_SEARCHES, "speculative.ngram_search", sp.ngram_search,
          f"choose one of {', '.join(NGRAM_SEARCHES)}")
    _need(sp.prompt_lookup_max >= sp.prompt_lookup_min, "speculative.prompt_lookup_max", sp.prompt_lookup_max,
          f"must be >= speculative.prompt_lookup_min ({sp.prompt_lookup_min})")
    n = sp.disable_by_batch_size
    _need(n is None or n >= 1, "speculative.disable_by_batch_size", n, "must be >= 1 or null")
    n = sp.split_pass_tokens
    _need(n is None or n >= 0, "speculative.split_pass_tokens", n, "must be >= 0 or null")


def check_settings(s: EngineSettings) -> None:
    """Raise KvbatchConfigError when an engine.* setting (batch sizes, prefill chunk, options) is out of range."""
    for key in ("max_batch", "prefill_tokens"):
        v = getattr(s, key)
        _need(v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), f"engine.{key}", v,
              "must be auto or an integer >= 1")
    _need(s.prefill_chunk >= 1, "engine.prefill_chunk", s.prefill_chunk, "must be >= 1")
    _need(s.admission in ADMISSIONS, "engine.admission", s.admission, f"choose one of {', '.join(ADMISSIONS)}")
    o = s.options
    for name, choices in _CHOICES.items():
        _need(getattr(o, name) in choices, f"engine.options.{name}", getattr(o, name),
              f"choose one of {', '.join(choices)}")
    _need(o.attention_threads >= 0, "engine.options.attention_threads", o.attention_threads, "must be >= 0 (0 = auto)")
    _need(o.multi_query >= 1, "engine.options.multi_query", o.multi_query, "must be >= 1 (1 = the prefill path)")
    c = o.cuda
    for f in fields(c):
        if f.type in ("int", int):
            _need(getattr(c, f.name) >= 0, f"engine.options.cuda.{f.name}", getattr(c, f.name), "must be >= 0")
