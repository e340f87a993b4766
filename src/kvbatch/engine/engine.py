"""The engine: continuous batching over the paged KV cache, driven one step at a time.

`add(request)` queues a row; each `step()` admits what fits (and prefills it), runs one
decode step and returns the rows that finished. A row that ends frees its pages at once and
the next waiting row is admitted before the next step. The work is split as vLLM v1 splits
it, at kvbatch's scale: the Scheduler decides which rows run (admission against the memory
model, refusals), the Runner runs forward passes and sampling (a SyncStepper or a
LookaheadStepper for decode), the OutputProcessor applies stop rules and builds results.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine import mlx_lm_bridge
from kvbatch.engine.backend import on_cpu
from kvbatch.engine.batch_limits import resolve_max_batch, resolve_prefill_tokens
from kvbatch.engine.config import EngineConfig
from kvbatch.engine.errors import KvbatchConfigError, RowError
from kvbatch.engine.gate import check_kv_mode
from kvbatch.engine.grammar import Grammars
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.memory import MemoryModel, format_plan, layout_for, resolve_budget
from kvbatch.engine.output import OutputProcessor
from kvbatch.engine.row import Row
from kvbatch.engine.runner import LookaheadStepper, Runner, SyncStepper
from kvbatch.engine.sampling import RowSampler
from kvbatch.engine.scheduler import Scheduler
from kvbatch.engine.types import Logprobs, ModelSpec, Request, Result

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _raise_cache_limit(step_bytes: int) -> None:
    """Let MLX keep freed buffers of one step's size for reuse (never lowers the limit).

    MLX's CPU build caches at most 32 MiB of freed buffers. A decode step's temporaries
    (every layer's gathered K/V) exceed that from batch ~8 on, and then every step maps
    fresh pages from the OS (benchmarks/notebook/README.md, issue 3). The memory model already
    prices this workspace inside the budget.
    """
    old = mx.set_cache_limit(step_bytes)
    if old > step_bytes:
        mx.set_cache_limit(old)


class Engine:
    def __init__(self, model: nn.Module, tokenizer, spec: ModelSpec, cfg: Optional[EngineConfig] = None,
                 hooks: Optional[EngineHooks] = None):
        cfg = cfg or EngineConfig()
        cfg.check()
        kv, settings, opts = cfg.kv, cfg.engine, cfg.engine.options
        check_kv_mode(spec, kv, opts)
        if not mlx_lm_bridge.model_supports_paging(model):
            raise KvbatchConfigError(f"model type '{spec.family}' does not route attention through mlx-lm's "
                                     "scaled_dot_product_attention; the paged cache cannot run it")
        mlx_lm_bridge.prepare_model(model, opts)
        self.model, self.tokenizer, self.spec, self.cfg = model, tokenizer, spec, cfg
        self.hooks = hooks or EngineHooks()
        budget = cfg.memory.budget_bytes
        if budget is None:
            budget = resolve_budget("auto", cfg.memory.fraction, cfg.memory.headroom, resident=spec.weights_bytes)
        self.layout = layout_for(spec, kv)
        self.max_batch, self.max_batch_why = resolve_max_batch(settings.max_batch)
        self.prefill_tokens = resolve_prefill_tokens(settings.prefill_tokens, settings.prefill_chunk)
        self.memory = MemoryModel(spec, self.layout, int(budget), settings.prefill_chunk, self.max_batch,
                                  self.prefill_tokens)
        _raise_cache_limit(min(self.memory.workspace(self.max_batch, spec.context_length),
                               max(int(budget) - spec.weights_bytes, 0)))
        dtype = _DTYPES[spec.dtype]
        self.cache = PagedKVCache(self.layout, spec.num_layers, dtype, tail_slots=self.max_batch,
                                  upcast=dtype == mx.float16, query_heads=spec.num_heads, options=opts,
                                  prefix_cache=settings.prefix_cache)
        self.scheduler = Scheduler(spec, self.memory, self.cache, self.max_batch, kv.page_size,
                                   cfg.max_prompt_tokens, settings.admission, self.prefill_tokens)
        self.output = OutputProcessor(tokenizer, spec, self.layout, self.cache, self.hooks, self._unschedule)
        self.grammars = Grammars(tokenizer, spec.vocab_size, self.output.eos_ids)
        self.runner = Runner(model, self.cache, self.scheduler, self.output, self.hooks, self.memory.budget,
                             self.grammars)
        # lookahead overlaps the host's graph building with the device: GPU backends only by default
        # (the CPU does both); the attention trace reads every layer, so it never overlaps
        self.lookahead = (opts.lookahead == "on" or (opts.lookahead == "auto" and not on_cpu())) \
            and not self.cache.trace
        self.stepper = LookaheadStepper(self.runner, spec.context_length) if self.lookahead \
            else SyncStepper(self.runner)
        self.runner.flush = self.stepper.flush

    # ---- public surface --------------------------------------------------------------------
    def add(self, req: Request, score=None) -> None:
        """Queue a row; it is admitted by a later step() when a slot and memory allow. score: a
        TeacherForced scorer (engine/scoring.py, which adds such rows itself)."""
        p = req.sampling
        worst = min(len(req.prompt_tokens) + max(p.max_tokens, 0), self.spec.context_length)
        matcher, problem = None, None
        if p.grammar is not None:
            try:
                matcher = self.grammars.matcher(p.grammar)
            except RowError as e:
                problem = (e.code, e.message)
        row = Row(req, CacheRow(req.key), RowSampler(p, req.prompt_tokens, self.output.eos_ids, matcher), worst,
                  time.perf_counter(), forced=self.hooks.forced_tokens.get(req.key), score=score)
        if p.logprobs or p.prompt_logprobs:
            row.logprobs = Logprobs(prompt=[] if p.prompt_logprobs else None)
        if problem:  # a grammar llguidance rejects: the row ends now, with its error
            self.output.finish(row, "error", *problem)
            return
        self.scheduler.add(row)

    def step(self) -> list[Result]:
        """One scheduler iteration: admit what fits, run one prefill pass over the admitted rows'
        prompt chunks, then one decode step of the rows past their prompt; the rows that
        finished, in the order they finished."""
        s = self.scheduler
        while (decision := s.next_admission()) is not None:
            row, problem = decision
            if problem:
                self.output.finish(row, "error", *problem)
        batch = s.prefill_batch()
        if batch:
            self.runner.prefill(batch)
        if self.stepper.inflight or any(not r.prefilling for r in s.running):
            self.stepper.step()
            self.hooks.on_decode_step()
        done = list(self.output.done)
        self.output.done.clear()
        return done

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.output.done)

    def cancel(self) -> list[Request]:
        """Stop every waiting and running row now, free their pages, and return their requests
        (a worker at its deadline hands them back to the queue). Finished results not yet
        returned by step() are kept."""
        s = self.scheduler
        reqs = [r.req for r in s.waiting] + [r.req for r in s.running]
        self.stepper.drop()
        for r in s.running:
            self.cache.release(r.kv)
            r.active = False
        s.waiting.clear()
        s.running.clear()
        return reqs

    def run(self) -> Iterator[Result]:
        """Results as rows finish, until nothing is waiting or running."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests: list[Request]) -> list[Result]:
        """Every request to its end; results in request order."""
        for r in requests:
            self.add(r)
        by_key = {}
        while self.has_unfinished():
            by_key.update((res.key, res) for res in self.step())
        return [by_key[r.key] for r in requests]

    def plan(self, worst_tokens: int, max_prompt: int | None = None) -> dict:
        """Memory plan for rows of `worst_tokens` (prompt + max_tokens) each, prompts of at most
        `max_prompt` tokens (None: up to worst_tokens): see MemoryModel.plan."""
        plan = self.memory.plan(worst_tokens, max_prompt)
        plan.update(max_batch=self.max_batch, max_batch_why=self.max_batch_why,
                    admission=self.cfg.engine.admission, prefill_tokens=self.prefill_tokens,
                    prefix_cache=self.cfg.engine.prefix_cache)
        return plan

    def plan_line(self, worst_tokens: int, max_prompt: int | None = None) -> str:
        """The one-line start-up plan ("memory plan: budget ..., weights ..., KV ... B/token, N rows ...;
        batch: up to M rows (why), admission ...")."""
        return format_plan(self.plan(worst_tokens, max_prompt))

    def summary(self) -> dict:
        c, t, sh = self.cache, self.runner.times, self.scheduler.sharing
        return {
            "kv_mode": self.cfg.kv.mode, "route": c.route, "page_size": self.cfg.kv.page_size,
            "kv_k_axis": getattr(c.store, "k_axis", None),
            "group_size": self.cfg.kv.group_size if self.layout.quantized else None,
            "kv_label": self.layout.label, "key_bits": self.layout.key_bits, "value_bits": self.layout.value_bits,
            "rotate_keys": self.layout.rotate_keys, "full_precision_tokens": self.layout.full_precision_tokens,
            "kv_bytes_per_token": self.layout.bytes_per_token,
            "budget_bytes": self.memory.budget, "weights_bytes": self.spec.weights_bytes,
            "pool_capacity_pages": c.capacity_pages, "peak_capacity_pages": c.peak_capacity_pages,
            "pool_bytes": c.capacity_bytes, "peak_pages_in_use": c.pool.peak_in_use,
            "pages_in_use": c.pool.in_use, "growth_events": list(c.growth_events),
            "max_batch": self.max_batch, "max_batch_why": self.max_batch_why, "prefill_tokens": self.prefill_tokens,
            "admission": self.cfg.engine.admission, "preemptions": self.scheduler.preemptions,
            "peak_concurrency": self.scheduler.peak_concurrency, "generated_tokens": self.output.generated_tokens,
            "prefill_s": t.prefill_time, "decode_s": t.decode_time, "prefill_tokens_total": t.prefill_tokens,
            "prefill_passes": t.prefill_passes, "prefill_rows_max": t.prefill_rows_max,
            "prefill_tokens_per_s": t.prefill_tokens / t.prefill_time if t.prefill_time else None,
            "decode_tokens_per_s": t.decode_tokens / t.decode_time if t.decode_time else None,
            "prefix_cache": self.cfg.engine.prefix_cache, "prompt_tokens_cached": sh.cached_tokens,
            "forks": sh.forks, "pages_shared": c.pool.shared, "pages_cached": c.pool.num_cached,
            "pages_evictable": c.pool.num_evictable, "page_evictions": c.pool.evictions,
            "mlx_peak_memory_bytes": int(mx.get_peak_memory()),
            "rows_by_error_code": dict(self.output.results_by_code),
            "lookahead": self.lookahead, "options": asdict(self.cfg.engine.options),
        }

    # ---- internal --------------------------------------------------------------------------
    def _unschedule(self, row: Row) -> None:
        if row.active:  # a preempted row never ends while waiting: the step in flight lands first
            self.scheduler.running.remove(row)
            row.active = False
