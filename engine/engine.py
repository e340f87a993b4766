"""The engine: admission, chunked prefill, batched decode over the paged cache.

Continuous batching: up to `max_batch` rows decode together; a row that ends
frees its pages at once and the next waiting row is admitted before the next
step. Admission prices a row's worst case (prompt + max_tokens) next to the rows
already running; a row that can never fit ends with `insufficient_memory` before
any page is allocated for it.
"""
from __future__ import annotations

import os
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine import attention, errors, rope
from kvbatch.engine.errors import KvbatchConfigError, RowError
from kvbatch.engine.gate import check_kv_mode
from kvbatch.engine.kv_cache import CacheRow, PagedKVCache, trace_mode
from kvbatch.engine.lookahead import InflightStep, LookaheadDecode, lookahead_default
from kvbatch.engine.memory import MemoryModel, format_plan, kv_layout, resolve_budget
from kvbatch.engine.sampling import RowSampler, sample_batch
from kvbatch.engine.types import ModelSpec, Request, Result, RowStats

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class EngineConfig:
    kv_mode: str = "none"  # none | q8 | q4
    page_size: int = 64
    group_size: int = 64
    max_batch: int = 8
    prefill_chunk: int = 512
    memory_budget: Optional[int] = None  # total bytes (weights included); None = auto
    memory_fraction: float = 0.8
    memory_headroom: str = "1GiB"
    allow_unvalidated: bool = False
    max_prompt_tokens: Optional[int] = None
    inject_nonfinite: Optional[tuple[str, int]] = None  # testing only: (row key, output step)


@dataclass
class _Row:
    req: Request
    kv: CacheRow
    sampler: RowSampler
    worst: int
    t_submit: float
    out: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    ended: bool = False


def _forward_last(model: nn.Module, tokens: mx.array, cache: list) -> mx.array:
    """Logits of the last position only: skips the vocab projection of every prompt token."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "embed_tokens"):
        return model(tokens, cache=cache)[:, -1, :]
    h = inner(tokens, cache=cache)[:, -1:, :]
    head = getattr(model, "lm_head", None)
    out = head(h) if head is not None else inner.embed_tokens.as_linear(h)
    return out[:, -1, :]


def _raise_cache_limit(step_bytes: int) -> None:
    """Let MLX keep freed buffers of one step's size for reuse (never lowers the limit).

    MLX's CPU build caches at most 32 MiB of freed buffers. A decode step's temporaries
    (every layer's gathered K/V) exceed that from batch ~8 on, and then every step maps
    fresh pages from the OS: 8k minor faults and a 2.2x slower step at batch 32 on a
    4M-parameter llama (benchmarks/RESULTS.md, issue 3). The memory model already prices
    this workspace inside the budget.
    """
    old = mx.set_cache_limit(step_bytes)
    if old > step_bytes:
        mx.set_cache_limit(old)


class Engine(LookaheadDecode):
    def __init__(self, model: nn.Module, tokenizer, spec: ModelSpec, cfg: EngineConfig = EngineConfig()):
        for name, lo in (("page_size", 1), ("max_batch", 1), ("prefill_chunk", 1)):
            if getattr(cfg, name) < lo:
                raise KvbatchConfigError(f"engine/kv {name}={getattr(cfg, name)} must be >= {lo}")
        check_kv_mode(spec, cfg.kv_mode, cfg.group_size, cfg.allow_unvalidated)
        if not attention.model_supports_paging(model):
            raise KvbatchConfigError(f"model type '{spec.family}' does not route attention through mlx-lm's "
                                     "scaled_dot_product_attention; the paged cache cannot run it")
        attention.install(model)
        if attention.on_cpu() and os.environ.get("KVBATCH_ROPE_TABLE", "1") != "0":
            rope.install(model)  # decode RoPE from one table per step (engine/rope.py)
        else:
            rope.uninstall(model)
        self.model, self.tokenizer, self.spec, self.cfg = model, tokenizer, spec, cfg
        budget = cfg.memory_budget
        if budget is None:
            budget = resolve_budget("auto", cfg.memory_fraction, cfg.memory_headroom, resident=spec.weights_bytes)
        self.layout = kv_layout(spec, cfg.kv_mode, cfg.page_size, cfg.group_size)
        self.memory = MemoryModel(spec, self.layout, int(budget), cfg.prefill_chunk, cfg.max_batch)
        _raise_cache_limit(min(self.memory.workspace(cfg.max_batch, spec.context_length),
                               max(int(budget) - spec.weights_bytes, 0)))
        dtype = _DTYPES[spec.dtype]
        self.cache = PagedKVCache(self.layout, spec.num_layers, dtype, tail_slots=cfg.max_batch,
                                  upcast=dtype == mx.float16, trace=trace_mode(),
                                  query_heads=spec.num_heads)
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.waiting: deque[_Row] = deque()
        self.running: list[_Row] = []
        self._done: deque[Result] = deque()
        self.generated_tokens = 0
        self.peak_concurrency = 0
        self.decode_time = 0.0
        self.decode_tokens = 0
        self.prefill_time = 0.0
        self.prefill_tokens = 0
        self.results_by_code: dict[str, int] = {}
        self.lookahead = lookahead_default() and not self.cache.trace  # the trace reads every layer: no overlap

        self._inflight: Optional[InflightStep] = None
        self._t_accepted = 0.0

    # ---- public surface --------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        p = req.sampling
        worst = min(len(req.prompt_tokens) + max(p.max_tokens, 0), self.spec.context_length)
        self.waiting.append(_Row(req, CacheRow(req.key), RowSampler(p), worst, time.perf_counter()))

    def run(self, heartbeat_s: Optional[float] = None) -> Iterator[Optional[Result]]:
        """Yield results as rows finish, until nothing is waiting or running.

        With heartbeat_s, also yield None at least that often (between steps), so a
        caller can check a deadline mid-batch and call cancel()."""
        last = time.perf_counter()
        while self.waiting or self.running or self._done:
            self._admit()
            if self.running:
                self._decode_step()
            while self._done:
                last = time.perf_counter()
                yield self._done.popleft()
            if heartbeat_s is not None and time.perf_counter() - last >= heartbeat_s:
                last = time.perf_counter()
                yield None

    def cancel(self) -> list[Request]:
        """Stop every waiting and running row now, free their pages, and return their requests
        (a worker at its deadline hands them back to the queue). Finished results not yet
        yielded are kept."""
        reqs = [r.req for r in self.waiting] + [r.req for r in self.running]
        self._inflight = None  # its tokens are dropped with the rows
        for r in self.running:
            self.cache.release(r.kv)
        self.waiting.clear()
        self.running.clear()
        return reqs

    def generate(self, requests: list[Request]) -> list[Result]:
        for r in requests:
            self.submit(r)
        by_key = {r.key: r for r in self.run() if r is not None}
        return [by_key[r.key] for r in requests]

    def plan(self, worst_tokens: int, max_prompt: int | None = None) -> dict:
        """Memory plan for rows of `worst_tokens` (prompt + max_tokens) each, prompts of at most
        `max_prompt` tokens (None: up to worst_tokens): see MemoryModel.plan."""
        return self.memory.plan(worst_tokens, max_prompt)

    def plan_line(self, worst_tokens: int, max_prompt: int | None = None) -> str:
        """The one-line start-up plan ("memory plan: budget ..., weights ..., KV ... B/token, N rows ...")."""
        return format_plan(self.plan(worst_tokens, max_prompt))

    def summary(self) -> dict:
        c = self.cache
        return {
            "kv_mode": self.cfg.kv_mode, "route": c.route, "page_size": self.cfg.page_size,
            "kv_k_axis": getattr(c.store, "k_axis", None),
            "group_size": self.cfg.group_size if self.layout.bits else None,
            "kv_bytes_per_token": self.layout.bytes_per_token,
            "budget_bytes": self.memory.budget, "weights_bytes": self.spec.weights_bytes,
            "pool_capacity_pages": c.capacity_pages, "peak_capacity_pages": c.peak_capacity_pages,
            "pool_bytes": c.capacity_bytes, "peak_pages_in_use": c.pool.peak_in_use,
            "pages_in_use": c.pool.in_use, "growth_events": list(c.growth_events),
            "peak_concurrency": self.peak_concurrency, "generated_tokens": self.generated_tokens,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_time if self.prefill_time else None,
            "decode_tokens_per_s": self.decode_tokens / self.decode_time if self.decode_time else None,
            "mlx_peak_memory_bytes": int(mx.get_peak_memory()),
            "rows_by_error_code": dict(self.results_by_code),
        }

    # ---- admission -------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_batch:
            row = self.waiting[0]
            problem = self._refusal(row)
            if problem:
                self.waiting.popleft()
                self._finish(row, "error", *problem)
                continue
            if not self.memory.fits([r.worst for r in self.running] + [row.worst],
                                    max(len(r.req.prompt_tokens) for r in self.running + [row])):
                return  # waits for running rows to finish
            self.waiting.popleft()
            self.cache.admit(row.kv)
            self.running.append(row)
            self.peak_concurrency = max(self.peak_concurrency, len(self.running))
            self._prefill(row)

    def _refusal(self, row: _Row) -> Optional[tuple[str, str]]:
        req, n = row.req, len(row.req.prompt_tokens)
        p = req.sampling
        if n == 0:
            return errors.INVALID_INPUT, "empty prompt (0 tokens)"
        if p.max_tokens < 1:
            return errors.INVALID_INPUT, f"max_tokens must be >= 1, got {p.max_tokens}"
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
            return errors.INVALID_INPUT, f"bad sampling parameters: {p}"
        if any((not isinstance(t, int)) or t < 0 or t >= self.spec.vocab_size for t in req.prompt_tokens):
            return errors.INVALID_INPUT, "prompt has token ids outside the vocabulary"
        # the context must keep room for at least one generated token
        limit = self.spec.context_length - 1
        if self.cfg.max_prompt_tokens is not None:
            limit = min(limit, self.cfg.max_prompt_tokens)
        if n > limit:
            return errors.PROMPT_TOO_LONG, f"prompt has {n} tokens; the limit is {limit} (context {self.spec.context_length})"
        if not self.memory.fits([row.worst], n):
            need = self.memory.bytes_for([row.worst], n)
            return errors.INSUFFICIENT_MEMORY, (f"row needs {need} bytes at worst ({row.worst} tokens) "
                                                f"but the budget is {self.memory.budget}")
        return None

    def _pool_want(self) -> int:
        """Pages the running rows can hold at most, together: where pool growth may stop."""
        P = self.cfg.page_size
        return sum(-(-r.worst // P) for r in self.running)

    def _kv_limit(self) -> int:
        worst = [r.worst for r in self.running] or [1]
        prompt = max((len(r.req.prompt_tokens) for r in self.running), default=1)
        return self.memory.budget - self.spec.weights_bytes - self.memory.workspace(len(worst), max(worst), prompt)

    def _poison(self, rows: list[_Row], ahead: frozenset = frozenset()) -> Optional[list[bool]]:
        """ahead: rows with one token in flight (their next output step is len(out) + 1)."""
        inj = self.cfg.inject_nonfinite
        if not inj:
            return None
        return [r.req.key == inj[0] and len(r.out) + (id(r) in ahead) == int(inj[1]) for r in rows]

    # ---- forward passes --------------------------------------------------------------------
    def _prefill(self, row: _Row) -> None:
        t0 = time.perf_counter()
        toks, chunk = row.req.prompt_tokens, self.cfg.prefill_chunk
        try:
            for start in range(0, len(toks), chunk):
                piece = toks[start:start + chunk]
                self.cache.reserve(row.kv, len(piece), self._kv_limit(), self._pool_want())
                self.cache.begin([row.kv], len(piece), self._poison([row]))
                try:
                    logits = _forward_last(self.model, mx.array([piece]), self.cache.views)
                    if start + chunk < len(toks):
                        mx.eval(self.cache.store.all_arrays())
                    else:
                        logits = logits.astype(mx.float32)
                        token = sample_batch(logits, [row.sampler])
                        finite = mx.isfinite(logits).all(axis=-1)
                        mx.eval(token, finite)
                finally:
                    self.cache.end()
        except RowError as e:
            self._end_running(row, "error", e.code, e.message)
            return
        except Exception as e:  # confined to this row
            self._end_running(row, "error", errors.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
            return
        self._t_accepted = time.perf_counter()  # lookahead: decode time restarts after a prefill
        self.prefill_time += self._t_accepted - t0
        self.prefill_tokens += len(toks)
        self._trim_cache()
        self._accept([row], logits, token, finite)

    def _decode_step(self) -> None:
        if self.lookahead:
            self._decode_step_lookahead()
            return
        rows = []
        limit, want = self._kv_limit(), self._pool_want()  # once per step: they scan every running row
        for r in list(self.running):
            try:
                self.cache.reserve(r.kv, 1, limit, want)
                rows.append(r)
            except RowError as e:
                self._end_running(r, "error", e.code, e.message)
        if not rows:
            return
        t0 = time.perf_counter()
        inputs = mx.array([[r.out[-1]] for r in rows])
        try:
            self.cache.begin([r.kv for r in rows], 1, self._poison(rows))
            try:
                logits, tokens, finite = self._forward_sample(rows, inputs)
                mx.eval(tokens, finite)
            finally:
                self.cache.end()
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            for r in rows:
                self._end_running(r, "error", errors.INTERNAL_ERROR, msg)
            traceback.print_exc()
            return
        self.decode_time += time.perf_counter() - t0
        self.decode_tokens += len(rows)
        self._trim_cache()
        self._accept(rows, logits, tokens, finite)

    def _forward_sample(self, rows: list[_Row], inputs: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """One decode forward of (B, 1) inputs, lazily: float32 logits, sampled tokens, finite flags."""
        logits = _forward_last(self.model, inputs, self.cache.views).astype(mx.float32)
        return logits, sample_batch(logits, [r.sampler for r in rows]), mx.isfinite(logits).all(axis=-1)

    def _trim_cache(self) -> None:
        """MLX keeps freed buffers in its cache (process memory too; step sizes change every
        step, so it grows): give it back once active + cached would pass the budget."""
        if mx.get_active_memory() + mx.get_cache_memory() > self.memory.budget:
            mx.clear_cache()

    def _accept(self, rows: list[_Row], logits: mx.array, tokens: mx.array, finite: mx.array) -> None:
        now = time.perf_counter()
        toks, ok = tokens.tolist(), finite.tolist()
        for i, r in enumerate(rows):
            if r.ended:  # lookahead: the row stopped on its previous token; this step's output is dropped
                continue
            if not ok[i]:
                nan = int(mx.isnan(logits[i]).sum().item())
                inf = int(mx.isinf(logits[i]).sum().item())
                self._end_running(r, "error", errors.NON_FINITE_LOGITS,
                                  f"non-finite logits at output step {len(r.out)}: {nan} NaN, {inf} inf")
                continue
            if r.req.capture_logits:
                r.logits.append(logits[i])
            forced = r.req.forced_tokens
            tok = forced[len(r.out)] if forced is not None and len(r.out) < len(forced) else toks[i]
            if r.t_first is None:
                r.t_first = now
            r.t_last = now
            p = r.req.sampling
            if forced is None and (tok in self.eos_ids or tok in p.stop_token_ids):
                self._end_running(r, "stop")
                continue
            r.out.append(tok)
            self.generated_tokens += 1
            if p.stop and self._hit_stop_string(r):
                self._end_running(r, "stop")
            elif len(r.out) >= p.max_tokens or len(r.req.prompt_tokens) + len(r.out) >= self.spec.context_length \
                    or (forced is not None and len(r.out) >= len(forced)):
                self._end_running(r, "length")

    def _hit_stop_string(self, r: _Row) -> bool:
        window = max(len(s) for s in r.req.sampling.stop) + 8
        tail = self.tokenizer.decode(r.out[-window:])
        return any(s in tail for s in r.req.sampling.stop)

    # ---- endings ---------------------------------------------------------------------------
    def _end_running(self, row: _Row, reason: str, code: Optional[str] = None, msg: Optional[str] = None) -> None:
        if row in self.running:
            self.running.remove(row)
        self._finish(row, reason, code, msg)

    def _finish(self, row: _Row, reason: str, code: Optional[str] = None, msg: Optional[str] = None) -> None:
        row.ended = True
        peak_kv = row.kv.peak_pages * self.layout.page_bytes
        if row.kv.tail is not None or (self.layout.bits and row.kv.peak_pages):
            peak_kv += self.layout.page_size * self.layout.dense_bytes_per_token
        if reason == "error":  # its K/V may be NaN/inf: zeroed before the pages are reused
            self.cache.release(row.kv, scrub=True)
        else:
            self.cache.release(row.kv)
        text = self.tokenizer.decode(row.out) if row.out else ""
        if reason == "stop" and row.req.sampling.stop:
            for s in row.req.sampling.stop:
                if s in text:
                    text = text[: text.index(s)]
        n = len(row.out)
        decode_tps = None
        if n > 1 and row.t_last and row.t_first and row.t_last > row.t_first:
            decode_tps = (n - 1) / (row.t_last - row.t_first)
        stats = RowStats(prompt_tokens=len(row.req.prompt_tokens), output_tokens=n,
                         ttft_s=(row.t_first - row.t_submit) if row.t_first else None,
                         decode_tps=decode_tps, wall_s=time.perf_counter() - row.t_submit,
                         peak_kv_bytes=peak_kv, route=self.cache.route)
        key = code or "ok"
        self.results_by_code[key] = self.results_by_code.get(key, 0) + 1
        self._done.append(Result(row.req.key, list(row.out), text, reason, code, msg, stats,
                                 row.logits if row.req.capture_logits else None))
