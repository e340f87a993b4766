"""The engine: continuous batching over the paged KV cache, driven one step at a time.

`add(request)` queues a row; each `step()` admits what fits (and prefills it), runs one
decode step and returns the rows that finished. A row that ends frees its pages at once and
the next waiting row is admitted before the next step. The work is split as vLLM v1 splits
it, at kvbatch's scale: a step is schedule -> run -> output. The Scheduler decides which rows
run and reserves their pages (admission against the memory model, refusals, preemption) in a
StepPlan (engine/plan.py); the Runner runs its forward passes and sampling (a SyncStepper or a
LookaheadStepper for decode) and returns their tokens; the OutputProcessor applies stop rules,
builds results and says which rows ended, which the engine takes out of the batch.

Clients (the pipeline's worker, tests, benchmarks) use the public surface below and
`EngineHooks` (engine/hooks.py), never the parts.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import get_total_parameters

from kvbatch.engine import lora, mlx_lm_bridge
from kvbatch.engine.backend import on_cpu
from kvbatch.engine.batch_limits import resolve_max_batch, resolve_prefill_tokens
from kvbatch.engine.config import EngineConfig
from kvbatch.engine.errors import INTERNAL_ERROR, INVALID_INPUT, KvbatchConfigError, RowError
from kvbatch.engine.gate import check_kv_mode
from kvbatch.engine.grammar import Grammars
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv import offload
from kvbatch.engine.kv.offload import KVFile
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.memory import MemoryModel, format_plan, layout_for, resolve_budget
from kvbatch.engine.output import OutputProcessor
from kvbatch.engine import resume
from kvbatch.engine.plan import Chunk, StepPlan
from kvbatch.engine.row import Row
from kvbatch.engine.runner import Decoded, LookaheadStepper, PrefillPass, Runner, SyncStepper, TokenPass
from kvbatch.engine.sampling import RowSampler
from kvbatch.engine.scheduler import Scheduler
from kvbatch.engine.speculative import Proposer, make_proposer
from kvbatch.engine.speculative.draft import DraftProposer, draft_model
from kvbatch.engine.speculative.speculator import Speculator
from kvbatch.engine.types import Logprobs, ModelSpec, Request, Result, RowCheckpoint

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class _Unread:
    """A verification pass read and its outputs not yet applied: what it gave, its rows, and the rows whose
    kept tokens stand at the end of their `out` meanwhile (with how many)."""

    done: Decoded
    rows: list[Row]
    extended: list[tuple[Row, int]]


def _raise_cache_limit(step_bytes: int) -> None:
    """Let MLX keep freed buffers of one step's size for reuse (never lowers the limit).

    MLX's CPU build caches at most 32 MiB of freed buffers. A decode step's temporaries
    (every layer's gathered K/V) exceed that from batch ~8 on, and then every step maps
    fresh pages from the OS (docs/performance.md). The memory model already
    prices this workspace inside the budget.
    """
    old = mx.set_cache_limit(step_bytes)
    if old > step_bytes:
        mx.set_cache_limit(old)


class Engine:
    """Continuous batching over the paged KV cache: `add` queues requests, each `step` runs one scheduling step and
    returns the results that finished."""

    def __init__(self, model: nn.Module, tokenizer, spec: ModelSpec, cfg: Optional[EngineConfig] = None,
                 hooks: Optional[EngineHooks] = None, draft: Optional[tuple[nn.Module, Any, ModelSpec]] = None):
        """draft: (model, tokenizer, spec) of the draft model speculative.method=draft proposes with."""
        cfg = cfg or EngineConfig()
        cfg.check()
        kv, settings, opts = cfg.kv, cfg.engine, cfg.engine.options
        draft = draft_model(cfg.speculative.method, tokenizer, spec, draft)
        for m, sp in [(model, spec)] + ([(draft[0], draft[2])] if draft else []):
            check_kv_mode(sp, kv, opts)
            if not mlx_lm_bridge.model_supports_paging(m):
                raise KvbatchConfigError(f"model type '{sp.family}' does not route attention through mlx-lm's "
                                         "scaled_dot_product_attention; the paged cache cannot run it")
            mlx_lm_bridge.prepare_model(m, opts)
        self.model, self.tokenizer, self.spec, self.cfg = model, tokenizer, spec, cfg
        self.hooks = hooks or EngineHooks()
        budget = cfg.memory.budget_bytes
        if budget is None:
            budget = resolve_budget("auto", cfg.memory.fraction, cfg.memory.headroom,
                                    resident=spec.weights_bytes + (draft[2].weights_bytes if draft else 0))
        if cfg.memory.limit_allocator:
            mx.set_memory_limit(int(budget))
        self.layout = layout_for(spec, kv)
        limit = resolve_max_batch(settings.max_batch, get_total_parameters(model))
        self.max_batch, self.max_batch_why = limit.rows, limit.why
        if cfg.rows is not None and 0 < cfg.rows < self.max_batch:  # a small job: slots for its rows only
            self.max_batch, self.max_batch_why = cfg.rows, f"the job's {cfg.rows} rows; {self.max_batch_why}"
        self.prefill_tokens = resolve_prefill_tokens(settings.prefill_tokens, settings.prefill_chunk)
        proposer: Optional[Proposer] = make_proposer(cfg.speculative)
        # lookahead overlaps the host's graph building with the device: GPU backends only by default
        # (the CPU does both); the attention trace reads every layer, so it never overlaps. Proposals
        # need each row's tokens on the host: a step that proposes lands the step in flight first, and
        # the steps that do not propose (speculative.adaptive, disable_by_batch_size) keep the overlap
        self.lookahead = (opts.lookahead == "on" or (opts.lookahead == "auto" and not on_cpu())) \
            and opts.attention_trace == "off"
        window = 1 + cfg.speculative.num_tokens if cfg.speculative.method != "none" else 1
        draft_memory = None if draft is None else MemoryModel(
            draft[2], layout_for(draft[2], kv), int(budget), settings.prefill_chunk, self.max_batch,
            self.prefill_tokens, window)
        self.memory = MemoryModel(spec, self.layout, int(budget), settings.prefill_chunk, self.max_batch,
                                  self.prefill_tokens, window, draft=draft_memory,
                                  window_in_flight=self.lookahead and window > 1)
        _raise_cache_limit(min(self.memory.workspace(self.max_batch, spec.context_length),
                               max(int(budget) - self.memory.weights_bytes, 0)))
        dtype = _DTYPES[spec.dtype]
        self.cache = PagedKVCache(self.layout, spec.num_layers, dtype, tail_slots=self.max_batch,
                                  upcast=dtype == mx.float16, query_heads=spec.num_heads, options=opts,
                                  prefix_cache=settings.prefix_cache)
        self.output = OutputProcessor(tokenizer, spec, self.layout, self.cache, self.hooks)
        self.grammars = Grammars(tokenizer, spec.vocab_size, set(self.output.eos_ids))
        self.adapters = lora.of(model)
        self.runner = Runner(model, self.cache, self.hooks, self.memory.budget, self.grammars, self.adapters)
        if draft is not None and draft_memory is not None:
            dspec = draft[2]
            ddtype = _DTYPES[dspec.dtype]
            dcache = PagedKVCache(draft_memory.layout, dspec.num_layers, ddtype, tail_slots=self.max_batch,
                                  upcast=ddtype == mx.float16, query_heads=dspec.num_heads, options=opts,
                                  prefix_cache=settings.prefix_cache)
            proposer = DraftProposer(draft[0], dcache, lambda: self.scheduler.kv_limit(draft=True),
                                     settings.prefill_chunk)
        self.speculator = Speculator(cfg.speculative, proposer, self.runner, spec.context_length, kv.page_size,
                                     self.layout.quantized, pipelined=self.lookahead) if proposer else None
        self._mark: Optional[float] = None  # since when landed tokens' cost is unrecorded (Payoff)
        # with the lookahead, a verification pass stays in flight while the host builds nothing else (Speculator.send):
        # the next step reads it, builds the next pass from its tokens and hands that to the device, and only
        # then applies its outputs (stop rules, results), which the device no longer waits for. Between the read
        # and the outputs: the pass read, and each row's kept tokens (_land_pass, _read_pass)
        self._unread: Optional[_Unread] = None
        self.stepper = LookaheadStepper(self.runner) if self.lookahead \
            else SyncStepper(self.runner)
        # a preemption first lands the decode step in flight: its rows still write the pages it frees
        self.scheduler = Scheduler(spec, self.memory, self.cache, self.max_batch, kv.page_size,
                                   cfg.max_prompt_tokens, settings.admission, self.prefill_tokens, self._flush,
                                   at_worst_from=limit.at_worst_from)

    # ---- public surface --------------------------------------------------------------------
    def add(self, req: Request, score=None, checkpoint: Optional[RowCheckpoint] = None,
            kv_file: Optional[KVFile] = None) -> None:
        """Queue a row; it is admitted by a later step() when a slot and memory allow. score: a
        TeacherForced scorer (engine/scoring.py, which adds such rows itself). checkpoint: the row
        continues from these kept tokens (engine/resume.py; CheckpointRefused when it cannot: the
        caller starts it over). kv_file: with a checkpoint, the row's K/V pages kept on disk by save_kv: read
        at its admission, the pages that hold loaded instead of prefilled (kv/offload.py)."""
        p = req.sampling
        worst = min(len(req.prompt_tokens) + max(p.max_tokens, 0), self.spec.context_length)
        matcher, problem = None, None
        if p.grammar is not None:
            try:
                matcher = self.grammars.matcher(p.grammar)
            except RowError as e:
                problem = (e.code, e.message)
        adapter = self._adapter(req.adapter)
        if adapter is None:
            names = ", ".join(self.adapters.index) if self.adapters else "none are set"
            problem, adapter = (INVALID_INPUT, f"adapter {req.adapter!r} is not one of model.adapters ({names})"), 0
        # a row's K/V depends on its adapter: its cached pages are named under the adapter's name
        kv = CacheRow(req.key, salt=req.adapter.encode() if adapter and req.adapter else None)
        row = Row(req, kv, RowSampler(p, req.prompt_tokens, self.output.eos_ids, matcher), worst,
                  time.perf_counter(), forced=self.hooks.forced_tokens.get(req.key), score=score, adapter=adapter)
        if p.logprobs or p.prompt_logprobs:
            row.logprobs = Logprobs(prompt=[] if p.prompt_logprobs else None)
        if checkpoint is not None and not problem:
            why = resume.problem(row, checkpoint, self.spec.vocab_size, self.spec.context_length) \
                or resume.restore(row, checkpoint)
            if why:
                raise resume.CheckpointRefused(why)
            row.kv_file = kv_file
        if problem:  # a grammar llguidance rejects: the row ends now, with its error
            self.output.finish(row, "error", *problem)
            return
        self.scheduler.add(row)

    def step(self) -> list[Result]:
        """One scheduler iteration: admit what fits, run one prefill pass over the admitted rows'
        prompt chunks, then one decode step of the rows past their prompt; the rows that
        finished, in the order they finished."""
        plan = self.scheduler.schedule()
        for r in plan.refused + plan.no_room:  # never ran, or taken out of the batch
            self.output.finish(r.row, "error", r.code, r.message)
        if plan.prefill:
            self._prefill(plan.prefill)
        plan = self._decode(plan)
        if self.speculator and not self.scheduler.running:
            self.speculator.proposer.forget()  # the last rows' draft pages go back with theirs
            self.speculator.drop()  # a pass whose rows all ended while it ran: nothing of it is kept
        self.hooks.on_step(plan, self.runner.times)
        done = list(self.output.done)
        self.output.done.clear()
        return done

    def _adapter(self, name: Optional[str]) -> Optional[int]:
        """A per-row adapter's index (0: the base model; None: the model has no adapter of that name)."""
        if name is None:
            return 0
        return self.adapters.index.get(name) if self.adapters is not None else None

    def has_unfinished(self) -> bool:
        """Whether any row is still waiting, running, or finished with its result not yet returned."""
        return bool(self.scheduler.waiting or self.scheduler.running or self.output.done)

    def cancel(self) -> list[Request]:
        """Stop every waiting and running row now, free their pages, and return their requests
        (a worker at its deadline hands them back to the queue). Finished results not yet
        returned by step() are kept."""
        s = self.scheduler
        reqs = [r.req for r in s.waiting] + [r.req for r in s.running]
        self.stepper.drop()
        if self.speculator:
            self.speculator.drop()
            self.speculator.proposer.forget(everything=True)
        for r in s.running:
            self.cache.release(r.kv)
            r.active = False
        s.waiting.clear()
        s.running.clear()
        return reqs

    def checkpoints(self, saved: Optional[dict[str, int]] = None, min_new: int = 1) -> dict[str, RowCheckpoint]:
        """Row key -> checkpoint of every row not ended (running, or waiting after a preemption) that
        holds at least `min_new` tokens more than `saved` says it had at its last checkpoint (none: 0),
        at this step boundary (a lookahead step in flight is not in it: the row is read at its landed
        tokens, its random stream at their count)."""
        s, saved = self.scheduler, saved or {}
        return {r.req.key: resume.take(r) for r in (*s.running, *s.waiting)
                if not r.ended and len(r.out) - saved.get(r.req.key, 0) >= max(min_new, 1)}

    def save_kv(self, files: dict[str, KVFile], kept: Optional[dict[str, int]] = None) -> dict[str, int]:
        """Write the full pages of these rows (by key; rows not ended) to their files, each with the token
        ids its pages hold (for Engine.add's `kv_file`); at a step boundary, after the rows' checkpoints are
        taken. kept: by key, the output tokens of the row's stored checkpoint (its pages beyond them are
        not written: the row continues from that checkpoint). Returns the tokens saved by key (a row without
        a full page of known tokens: no file)."""
        s, saved, P = self.scheduler, {}, self.cache.P
        layout = self.cache.layout_id
        for r in s.running:
            f = files.get(r.req.key)
            if f is None or r.ended or r.prefilling:
                continue
            out = min(len(r.out), kept.get(r.req.key, len(r.out))) if kept is not None else len(r.out)
            # the K/V of every token but the last one sampled is stored: full pages of those (a lookahead
            # step in flight writes at the last one's position or later, never into these)
            n = min(r.kv.length, r.prompt_len + len(r.out) - 1, r.prompt_len + out) // P
            if n:
                offload.save(f.path, self.cache.page_arrays(r.kv, n), r.seq[:n * P], layout, f.identity)
                saved[r.req.key] = n * P
        return saved

    def row_tokens(self) -> dict[str, int]:
        """Row key -> output tokens (carried-over ones included) of every row not ended, now. Cheap, and
        safe to call from another thread while step() runs (a copy of the row lists, taken under the
        GIL): what a worker's lease heartbeat records, not a step-exact count."""
        s = self.scheduler
        return {r.req.key: len(r.out) for r in (*s.running, *s.waiting) if not r.ended}

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

    def fits(self, worst_tokens: int, prompt_tokens: int) -> bool:
        """Whether one row of `worst_tokens` (prompt + max_tokens) with a prompt of `prompt_tokens`
        fits the memory budget alone (else every such row is refused)."""
        return self.memory.fits([worst_tokens], prompt_tokens)

    def compile_grammar(self, grammar: str) -> None:
        """Compile a grammar against this model's tokenizer (as a row asking for it would); raises
        RowError (invalid_input) when it cannot be used."""
        self.grammars.matcher(grammar)

    @property
    def speculation(self) -> Optional[tuple[int, int]]:
        """(tokens proposed, tokens accepted) so far; None without speculative decoding (cheap)."""
        v = self.speculator.verifier if self.speculator else None
        return (v.proposed, v.accepted) if v else None

    @property
    def generated_tokens(self) -> int:
        """Tokens generated so far (cheap: a worker reads it every step)."""
        return self.output.generated_tokens

    def stats(self) -> dict:
        """The engine's configuration and counters so far (a worker's summary.json)."""
        c, t, sh = self.cache, self.runner.times, self.scheduler.sharing
        return {
            "kv_mode": self.cfg.kv.mode, "route": c.route, "page_size": self.cfg.kv.page_size,
            "kv_k_axis": getattr(c.store, "k_axis", None),
            "group_size": self.cfg.kv.group_size if self.layout.quantized else None,
            "kv_label": self.layout.label, "key_bits": self.layout.key_bits, "value_bits": self.layout.value_bits,
            "rotate_keys": self.layout.rotate_keys, "full_precision_tokens": self.layout.full_precision_tokens,
            "kv_bytes_per_token": self.layout.bytes_per_token, "page_bytes": self.layout.page_bytes,
            "kv_tail_bytes": getattr(c.store, "tail_nbytes", 0),
            "budget_bytes": self.memory.budget, "weights_bytes": self.spec.weights_bytes,
            "pool_capacity_pages": c.capacity_pages, "peak_capacity_pages": c.peak_capacity_pages,
            "pool_bytes": c.capacity_bytes, "peak_pages_in_use": c.pool.peak_in_use,
            "pages_in_use": c.pool.in_use, "pages_free": c.pool.num_free, "growth_events": list(c.growth_events),
            "max_batch": self.max_batch, "max_batch_why": self.max_batch_why, "prefill_tokens": self.prefill_tokens,
            "admission": self.cfg.engine.admission, "preemptions": self.scheduler.preemptions,
            "rows_running": len(self.scheduler.running), "rows_waiting": len(self.scheduler.waiting),
            "peak_concurrency": self.scheduler.peak_concurrency, "generated_tokens": self.output.generated_tokens,
            "prefill_s": t.prefill_time, "decode_s": t.decode_time, "prefill_tokens_total": t.prefill_tokens,
            "prefill_passes": t.prefill_passes, "prefill_rows_max": t.prefill_rows_max,
            "prefill_tokens_per_s": t.prefill_tokens / t.prefill_time if t.prefill_time else None,
            "decode_tokens_per_s": t.decode_tokens / t.decode_time if t.decode_time else None,
            "prefix_cache": self.cfg.engine.prefix_cache, "prompt_tokens_cached": sh.cached_tokens,
            "kv_restored_tokens": sh.restored_tokens, "kv_files_unused": sh.files_unused,
            "kv_restore_s": sh.restore_s,
            "forks": sh.forks, "pages_shared": c.pool.shared, "pages_cached": c.pool.num_cached,
            "pages_evictable": c.pool.num_evictable, "page_evictions": c.pool.evictions,
            "mlx_peak_memory_bytes": int(mx.get_peak_memory()), "cache_clears": t.cache_clears,
            "rows_by_error_code": dict(self.output.results_by_code),
            "lookahead": self.lookahead, "decode_in_flight": self.stepper.inflight,
            "options": asdict(self.cfg.engine.options),
            "speculative": self.cfg.speculative.method,
            **(self.speculator.stats() if self.speculator else {}),
        }

    summary = stats  # an alias of stats() (tests and benchmarks call it)

    # ---- internal --------------------------------------------------------------------------
    def _prefill(self, chunks: tuple[Chunk, ...]) -> None:
        """Run the prefill pass; a row whose pass failed ends in error, a completed prompt gets its first token."""
        for p in self.runner.prefill(chunks):
            if p.error is not None:
                self._failed([p.chunks[0].row], p.error)
            elif p.done:
                self._first_tokens(p)

    def _first_tokens(self, p: PrefillPass) -> None:
        """Rows whose prompt the pass completed: a row with finite logits has its full pages cached
        and its waiting samples forked (they sample their first token from the same logits, each
        with its own random stream); then every one samples its first token."""
        assert p.logits is not None and p.finite is not None
        rows = [p.chunks[i].row for i in p.done]
        ok, out, pick = cast(list[bool], p.finite.tolist()), list(rows), list(range(len(rows)))
        for i, row in enumerate(rows):
            if ok[i]:
                forks = self.scheduler.prompt_done(row)
                for f in forks:
                    self.hooks.on_row_start(f.req.key)
                out += forks
                pick += [i] * len(forks)
        self._accept(self.runner.first_tokens(out, pick, p.logits, p.finite))

    def _decode(self, plan: StepPlan) -> StepPlan:
        """One decode step of the rows past their prompt (the plan completed with them)."""
        s, st, sp = self.scheduler, self.stepper, self.speculator
        flying = sp is not None and sp.inflight is not None
        if not (st.inflight or flying or any(not r.prefilling for r in s.running)):
            return plan
        if s.waiting and (st.frees_slot() or (sp is not None and sp.frees_slot())):
            self._flush()  # a slot frees with the step in flight: read it now, so the waiting row joins the next step
            self.hooks.on_decode_step()
            return plan
        n = len(plan.no_room)
        rows = st.candidates(s.decoding())
        speculate = sp is not None and sp.wants(len(rows))
        if (speculate and st.inflight) or (flying and not speculate):  # proposals need every row's tokens
            self._flush()
            rows, flying = st.candidates(s.decoding()), False
        t0, made = (self.hooks.clock(), self.output.generated_tokens) if sp else (0.0, 0)
        if flying:
            plan, chained = self._chain(plan, n, t0, made)
            if chained:
                return plan
            flying = sp is not None and sp.inflight is not None  # (a preemption for its windows read it)
        if flying:  # the rows that decode next: not those whose kept tokens end them whatever follows
            kept = self._land_pass()
            rows = [r for r in st.candidates(s.decoding())
                    if len(r.out) < r.end_at and not self.output.stops_on(r, kept.get(id(r), ()))]
        props = sp.propose(rows) if sp and speculate else {}
        windows = {id(r): 1 + len(p) for r in rows if (p := props.get(id(r)))} if props else None
        plan = s.schedule_decode(plan, rows, windows)
        verified = any(id(r) in props for r in plan.decode) if props else False
        if sp and verified:
            out = sp.send(list(plan.decode), props) if self.lookahead else sp.verify(list(plan.decode), props)
        else:
            out = st.step(list(plan.decode))
        self._read_pass()  # the pass landed above: its outputs while the next runs
        for step in out.landed:
            self.runner.land(step)
            self._accept(step)
        self._end_without_room(plan, n)
        if out.failed:
            self._failed(plan.decode, out.failed)
        if sp:  # what this step cost, for whether speculating pays (speculative.adaptive)
            from_pass = flying or (verified and sp.inflight is None)
            self._record_cost(sp, len(rows), from_pass, self.output.generated_tokens - made, t0)
        self.hooks.on_decode_step()
        return plan

    def _chain(self, plan: StepPlan, n: int, t0: float, made: int) -> tuple[StepPlan, bool]:
        """Where the pass in flight can have the next one chained after it (speculative/chain.py): the rows'
        windows reserved, the next pass built from its unread outputs and sent, then it is read and its outputs
        applied while the next one computes. The plan (with what reserving did: rows preempted or without room
        past plan.no_room[:n]) and whether the step ran so; if not, it goes on unchained."""
        sp, s = self.speculator, self.scheduler
        assert sp is not None
        got = sp.chainable(self.stepper.candidates(s.decoding()))
        if got is None:
            return plan, False
        rows, width = got
        plan = s.schedule_decode(plan, rows, {id(r): width for r in rows})
        if sp.inflight is None or plan.decode != tuple(rows) or not sp.chain(rows, width):
            return plan, False  # a preemption read the pass in flight, a row found no room, or no chained plan
        self._land_pass(extend=False)
        self._read_pass()
        self._end_without_room(plan, n)
        self._record_cost(sp, len(rows), True, self.output.generated_tokens - made, t0)
        self.hooks.on_decode_step()
        return plan, True

    def _end_without_room(self, plan: StepPlan, n: int) -> None:
        """The rows this step's reservations found no room for (plan.no_room past its first n) end in error,
        after the in-flight token they may still have had."""
        for r in plan.no_room[n:]:
            if not r.row.ended:
                self.output.finish(r.row, "error", r.code, r.message)

    def _land_pass(self, extend: bool = True) -> dict[int, list[int]]:
        """Read the verification pass in flight; its outputs wait for `_read_pass`. extend: the next pass is
        built from its tokens first, and until its outputs are applied each row's kept tokens stand at the end
        of its `out` (all that building a pass reads of them). Returns the kept tokens by id(row)."""
        assert self.speculator is not None
        done, kept, rows = self.speculator.land()
        extended = []
        for row in rows if extend else ():
            toks = kept.get(id(row))
            if toks:
                row.out.extend(toks)
                extended.append((row, len(toks)))
        self._unread = _Unread(done, rows, extended)
        return kept

    def _read_pass(self) -> None:
        """Apply the landed pass's outputs (stop rules, results): each row's kept tokens taken back off its
        `out` first, and handed to the OutputProcessor one output step at a time."""
        u, self._unread = self._unread, None
        if u is None:
            return
        for row, n in u.extended:
            del row.out[len(row.out) - n:]
        for step in u.done.landed:
            self.runner.land(step)
            self._accept(step)
        if u.done.failed:
            self._failed(u.rows, u.done.failed)

    def _record_cost(self, sp: Speculator, rows: int, verified: bool, tokens: int, t0: float) -> None:
        """Tell the speculator what a decode step gave and cost (verified: its tokens are a verification
        pass's). Without the lookahead a step costs its own time. With it, a step's tokens are those of a step
        or pass dispatched before, and they cost the time since the last landed tokens were counted (steady
        state: one step); a step that lands none (nothing was in flight) starts that count."""
        now = self.hooks.clock()
        if not self.lookahead:
            sp.record(rows, verified, tokens, now - t0)
        elif tokens:
            sp.record(rows, verified, tokens, now - (t0 if self._mark is None else self._mark))
            self._mark = now
        elif self._mark is None:
            self._mark = t0

    def _flush(self) -> None:
        """Land the decode step or verification pass in flight, if any, and apply its outputs (the Scheduler
        calls this before a preemption). Its tokens' cost is counted for the speculator (the wait included)."""
        sp, made = self.speculator, self.output.generated_tokens
        rows, verified = 0, False
        if sp is not None and sp.inflight is not None and self._unread is None:  # (else _decode read it already)
            rows, verified = len(sp.inflight.rows), True
            self._land_pass(extend=False)
        self._read_pass()
        step = self.stepper.take()
        if step is not None:
            rows = len(step.rows)
            self.runner.land(step)
            self._accept(step)
        if rows and sp is not None and self.lookahead and self._mark is not None:
            now = self.hooks.clock()
            sp.record(rows, verified, self.output.generated_tokens - made, now - self._mark)
            self._mark = None

    def _accept(self, p: TokenPass) -> None:
        for row in self.output.accept(p.rows, p.logits, p.sampled, p.finite, p.read):
            self.scheduler.unschedule(row)

    def _failed(self, rows: Sequence[Row], message: str) -> None:
        """A pass of these rows raised: each ends with internal_error, unless the device itself stopped evaluating
        (then no row is at fault, and DeviceFailure ends the engine's work instead) or the failed pass left the
        cache unreadable (CacheLost: every row must run again in a new engine)."""
        self.runner.check_failure(message)
        for row in rows:
            if not row.ended:
                self._end(row, "error", INTERNAL_ERROR, message)

    def _end(self, row: Row, reason: str, code: str, message: str) -> None:
        self.scheduler.unschedule(row)
        self.output.finish(row, reason, code, message)
