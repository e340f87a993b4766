"""Which rows run: the waiting queue, the running batch, admission and preemption against the
memory model, and which prompt chunks the next prefill pass takes.

Admission (`engine.admission`):
- `reserve` prices each running row at its worst case (prompt + max_tokens): a row admitted
  never runs out of room, but rows that end early held memory they never used;
- `optimistic` prices each row at what it holds now plus a margin. When a row's growth cannot
  fit, the rows admitted after it are preempted, most recent first (pages freed, generated
  tokens kept, back to the head of the queue); readmitted, they prefill prompt + generated
  tokens and continue. A row is refused (`insufficient_memory`) only when it cannot fit alone.
Rows past `at_worst_from` (engine.max_batch: auto on a backend with a second ceiling: batch_limits.py)
join only while every running row fits at its worst case, whatever the policy: admitting one never
lets the batch outgrow the budget. Every growth is priced before anything is allocated, under both
policies. A page several rows hold is priced once, and cached pages nobody holds are never priced:
they live in the pool's free pages and are evicted before anything is refused or preempted
(engine/sharing.py: which rows take cached pages, wait for a page another row is computing, or are
forked as samples).

`schedule()` makes a step's plan (engine/plan.py): admissions and refusals, the prefill pass's
chunks with their pages reserved, and the preemptions that made room; `schedule_decode()`
completes it with the decode rows once the prefill pass has landed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Callable, Optional

from kvbatch.engine import errors
from kvbatch.engine.errors import RowError
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.memory import MemoryModel
from kvbatch.engine.params import ids_outside
from kvbatch.engine.plan import Chunk, Refusal, StepPlan
from kvbatch.engine.row import Row
from kvbatch.engine.sharing import Sharing
from kvbatch.engine.types import ModelSpec

# optimistic: tokens of growth priced beyond what a running row holds now, in pages
MARGIN_PAGES = 2


class Scheduler:
    """Decides which rows run each step: the waiting queue, admission against the memory model, preemption, and prefill
    chunks."""

    def __init__(self, spec: ModelSpec, memory: MemoryModel, cache: PagedKVCache, max_batch: int,
                 page_size: int, max_prompt_tokens: Optional[int], admission: str = "reserve",
                 prefill_tokens: int = 0, flush: Callable[[], None] = lambda: None,
                 at_worst_from: Optional[int] = None):
        """flush: lands the decode step in flight, its rows that end leaving the batch (called
        before the first preemption of a reservation: that step's rows still write their pages).
        at_worst_from: rows past this many join only while every running row fits at its worst case."""
        self.spec, self.memory, self.cache, self.flush = spec, memory, cache, flush
        self.max_batch, self.page_size, self.max_prompt_tokens = max_batch, page_size, max_prompt_tokens
        self.optimistic = admission == "optimistic"
        self.at_worst_from = at_worst_from
        self.prefill_tokens = prefill_tokens
        self.margin = MARGIN_PAGES * page_size
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []  # in admission order
        self.peak_concurrency = 0
        self.preemptions = 0
        self._preempted: list[Row] = []  # since the last plan
        # during one admission loop: the running rows' priced totals, [rows counted, pages, largest price,
        # largest target] (admission only appends to `running`, so each admitted row is added once)
        self._totals: Optional[list[int]] = None
        self._worst_totals: Optional[list[int]] = None  # the same, at the rows' worst cases (admits)
        self.sharing = Sharing(self, cache)

    def add(self, row: Row) -> None:
        """Queue a row at the end of the waiting queue."""
        self.waiting.append(row)

    def decoding(self) -> list[Row]:
        """The running rows past their prefill."""
        return [r for r in self.running if not r.prefilling]

    def unschedule(self, row: Row) -> None:
        """The row leaves the running batch (it ended; its pages go with its result)."""
        if row.active:  # a preempted row never ends while waiting: the step in flight lands first
            self.running.remove(row)
            row.active = False

    # ---- the step's plan -------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Admit what fits, choose the prefill pass and reserve its chunks' pages: the step's plan
        up to its decode rows (schedule_decode)."""
        admitted, refused = [], []
        self._totals, self._worst_totals = [0, 0, 0, 0], [0, 0, 0, 0]
        try:
            while (decision := self.next_admission()) is not None:
                row, problem = decision
                if problem:
                    refused.append(Refusal(row, *problem))
                else:
                    admitted.append(row)
        finally:
            self._totals = self._worst_totals = None
        ready, no_room = [], []
        batch = self.prefill_batch()
        # one scan of the running rows for the whole pass: a chunk's reservation stays within its row's
        # target, so it changes no row's price (make_room refreshes them after a preemption)
        limits = self.limits() if batch else None
        for row, n in batch:
            if not row.active:  # preempted to make room for a row before it in this pass
                continue
            if self._room(row, n, limits, no_room):
                ready.append(Chunk(row, n))
        return StepPlan(tuple(admitted), tuple(refused), tuple(no_room), self._take_preempted(),
                        tuple(c for c in ready if c.row.active))

    def schedule_decode(self, plan: StepPlan, rows: list[Row], windows: Optional[dict[int, int]] = None) -> StepPlan:
        """The plan completed with its decode rows: room for one more token in each of `rows`
        (in admission order) that is still running; windows: tokens a row's verification writes
        instead (by id(row); speculative decoding)."""
        no_room: list[Refusal] = []
        limits: Optional[list[int]] = None  # scanned once, when the first row needs a page
        # most rows: their pages hold the step; the others get room in order (a preemption may take a later row)
        short = self.cache.hold([r.kv for r in rows], [windows.get(id(r), 1) for r in rows] if windows else None)
        for i in short:
            r = rows[i]
            if not r.active:  # preempted for an earlier row, or ended by a flush
                continue
            limits = self.limits() if limits is None else limits
            self._room(r, windows.get(id(r), 1) if windows else 1, limits, no_room)
        return replace(plan, no_room=plan.no_room + tuple(no_room),
                       preempted=plan.preempted + self._take_preempted(),
                       decode=tuple(r for r in rows if r.active))

    def _room(self, row: Row, n: int, limits: Optional[list[int]], no_room: list[Refusal]) -> bool:
        """make_room; a row that cannot fit alone leaves the batch and joins `no_room`."""
        try:
            return self.make_room(row, n, limits)
        except RowError as e:
            self.unschedule(row)
            no_room.append(Refusal(row, e.code, e.message))
            return False

    def _take_preempted(self) -> tuple[Row, ...]:
        out, self._preempted = tuple(self._preempted), []
        return out

    # ---- admission -------------------------------------------------------------------------
    def priced(self, r: Row) -> int:
        """Tokens the admission policy prices for a row."""
        if not self.optimistic:
            return r.worst
        return min(r.worst, max(r.kv.reserved, r.target) + self.margin)

    def admits(self, row: Row, shared_pages: int = 0) -> bool:
        """Whether the row may join the running rows now: they fit the budget together (`fits`), a row past
        `at_worst_from` at their worst cases (which no policy prices above, so that fit implies the other)."""
        past = self.at_worst_from is not None and len(self.running) >= self.at_worst_from
        return self.fits([row], shared_pages, at_worst=past)

    def fits(self, extra: list[Row], shared_pages: int = 0, at_worst: bool = False) -> bool:
        """Whether the running rows and `extra` fit the budget together, each priced by the admission
        policy (at_worst: at its worst case), the pages they share (beyond those shared now) priced once.
        In an admission loop the running rows' totals are kept (`_totals`, `_worst_totals`), not summed
        again for every row it admits."""
        price_of = (lambda r: r.worst) if at_worst else self.priced
        t = self._worst_totals if at_worst else self._totals
        if t is None:
            t = [0, 0, 0, 0]
        pages_for = self.memory.layout.pages_for
        for r in self.running[t[0]:]:
            price = price_of(r)
            t[1] += pages_for(price)
            t[2], t[3] = max(t[2], price), max(t[3], r.target)
        t[0] = len(self.running)
        prices = [price_of(r) for r in extra]
        pages = t[1] + sum(pages_for(p) for p in prices) - self.cache.pool.shared - shared_pages
        top, target = max([t[2], *prices]), max([t[3], *(r.target for r in extra)])
        return self.memory.bytes_for_pages(pages, t[0] + len(extra), top, target) <= self.memory.budget

    def next_admission(self) -> Optional[tuple[Row, Optional[tuple[str, str]]]]:
        """The next waiting row that can be decided now: (row, None) = admitted (its cache row
        taken, with the cached pages of its prefix: it is running and must be prefilled);
        (row, (code, message)) = refused. None: nothing more this step (no slot, or the first
        row must wait for memory). Samples waiting for their first sample's prompt are passed
        over: they are forked from it (Sharing.fork)."""
        if not self.waiting or len(self.running) >= self.max_batch:
            return None
        row = self.sharing.first_admissible(self.waiting)
        if row is None:
            return None
        problem = self.refusal(row)
        if problem:
            self.waiting.remove(row)
            return row, problem
        row.target = row.prompt_len + len(row.out)
        hit = self.sharing.hit(row)
        if not self.admits(row, sum(self.cache.pool.ref(p) > 0 for p in hit)):
            return None  # waits for running rows to finish
        self.waiting.remove(row)
        self.start(row)
        self.sharing.take(row, hit)
        self.sharing.restore(row)
        return row, None

    def start(self, row: Row) -> None:
        """The row joins the running batch (its tail slot taken)."""
        self.cache.admit(row.kv)
        self.running.append(row)
        row.active = True
        if row.t_admit is None:
            row.t_admit = time.perf_counter()
        self.peak_concurrency = max(self.peak_concurrency, len(self.running))

    def refusal(self, row: Row) -> Optional[tuple[str, str]]:
        """Why the row can never run here (its input, or its worst case over the whole budget); None: it can.
        The input checks scan every token, so a row that passed them is not scanned again while it waits."""
        n = row.prompt_len
        if not row.input_ok:
            problem = self._input_problem(row)
            if problem:
                return problem
            row.input_ok = True
        if not self.memory.fits([row.worst], n):
            need = self.memory.bytes_for([row.worst], n)
            return errors.INSUFFICIENT_MEMORY, (f"row needs {need} bytes at worst ({row.worst} tokens) "
                                                f"but the budget is {self.memory.budget}")
        return None

    def _input_problem(self, row: Row) -> Optional[tuple[str, str]]:
        req, n = row.req, row.prompt_len
        p = req.sampling
        if n == 0:
            return errors.INVALID_INPUT, "empty prompt (0 tokens)"
        if ids_outside(req.prompt_tokens, self.spec.vocab_size):
            return errors.INVALID_INPUT, "prompt has token ids outside the vocabulary"
        bad = p.problem(self.spec.vocab_size)
        if bad:
            return errors.INVALID_INPUT, bad
        # the context must keep room for at least one generated token
        limit = self.spec.context_length - 1
        if self.max_prompt_tokens is not None:
            limit = min(limit, self.max_prompt_tokens)
        if n > limit:
            return errors.PROMPT_TOO_LONG, (f"prompt has {n} tokens; the limit is {limit} "
                                            f"(context {self.spec.context_length})")
        return None

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_batch(self) -> list[tuple[Row, int]]:
        """The next prefill pass: (row, tokens) of admitted rows still prefilling, up to
        prefill_chunk tokens each and prefill_tokens in all (padded to the longest chunk; the
        first row always goes, so prefill_tokens=1 means one row a pass), and within the room
        the memory model gives a pass (MemoryModel.pass_room). Chosen longest chunks first, so a
        pass pads little; returned in admission order. Before it, rows take the cached pages that continue
        them, and rows whose next page an earlier row is computing are left out (Sharing)."""
        chunk = self.memory.prefill_chunk
        prefilling = [r for r in self.running if r.prefilling]
        if not prefilling:  # decode alone: nothing to take from the prefix cache either
            return []
        waits = self.sharing.before_prefill(prefilling)
        cands = sorted((r for r in prefilling if r.prefilling and id(r) not in waits),
                       key=lambda r: -self._chunk(r, chunk))
        if not cands:
            return []
        tokens = [self.priced(r) for r in self.running]
        cap = self.memory.pass_room(max(self.cache.pool.capacity, self.pool_want()), len(tokens), max(tokens),
                                    max(r.target for r in self.running))
        batch: list[tuple[Row, int]] = []
        L = T = 0
        for r in cands:
            n = self._chunk(r, chunk)
            L2, T2 = max(L, n), max(T, r.kv.length + n)
            if batch and ((len(batch) + 1) * L2 > self.prefill_tokens
                          or self.memory.prefill_pass(len(batch) + 1, L2, T2) > cap):
                continue
            batch.append((r, n))
            L, T = L2, T2
        order = {id(r): i for i, r in enumerate(self.running)}
        return sorted(batch, key=lambda b: order[id(b[0])])

    def _chunk(self, r: Row, chunk: int) -> int:
        """A row's next prefill chunk (a scored text's chunks end at page boundaries: engine/scoring.py)."""
        n = min(r.target - r.kv.length, chunk)
        return n if r.score is None else r.score.chunk(r.kv.length, n, self.page_size)

    # ---- growth ----------------------------------------------------------------------------
    def pool_want(self) -> int:
        """Pages the running rows can hold at most, together: where pool growth may stop."""
        P = self.page_size
        return sum(-(-r.worst // P) for r in self.running) - self.cache.pool.shared

    def kv_limit(self, draft: bool = False) -> int:
        """KV bytes the budget leaves next to the weights and the running rows' workspace: this
        model's pages' share of them (draft: the draft model's share, speculative.method=draft)."""
        tokens = [self.priced(r) for r in self.running] or [1]
        prompt = max((r.target for r in self.running), default=1)
        m = self.memory
        kv = m.budget - m.weights_bytes - m.workspace(len(tokens), max(tokens), prompt)
        own = m.layout.page_bytes
        return kv * (m.page_bytes - own if draft else own) // m.page_bytes

    def limits(self) -> list[int]:
        """[kv_limit, pool_want] for make_room (they scan every running row: once per step)."""
        return [self.kv_limit(), self.pool_want()]

    def make_room(self, row: Row, n_tokens: int, limits: Optional[list[int]] = None) -> bool:
        """Room for the row's next n_tokens (priced first). Under `optimistic`, when it cannot fit,
        the rows admitted after it are preempted, most recent first (flush() is called once
        before the first preemption: a decode step in flight must land first); when none is left,
        the row itself is preempted (False). Raises RowError when it cannot fit alone.
        limits: `limits()` of this step, refreshed here after a preemption."""
        limits = limits if limits is not None else self.limits()
        flushed = False
        while True:
            try:
                self.cache.reserve(row.kv, n_tokens, *limits)
                return True
            except RowError:
                if not self.optimistic or (self.running and self.running == [row]):
                    raise
            if not flushed:
                self.flush()  # rows that end with the step in flight free their pages
                flushed = True
                if not row.active:
                    return False
                limits[:] = self.limits()
                continue
            later = self.running[self.running.index(row) + 1:]
            self.preempt(later[-1] if later else row)
            if not later:
                return False
            limits[:] = self.limits()

    def preempt(self, row: Row) -> None:
        """Free a running row's pages and put it back at the head of the queue; its generated
        tokens are kept and prefilled again when it is readmitted. Its full pages stay cached for
        its readmission only once finite logits vouched for them: a row preempted mid-prefill holds
        K/V no logits have checked yet (a NaN there would reach every row that took the page)."""
        self.cache.release(row.kv, tokens=None if row.prefilling else row.seq)
        self.running.remove(row)
        row.active = False
        self.waiting.appendleft(row)
        row.preemptions += 1
        self.preemptions += 1
        self._preempted.append(row)

    def prompt_done(self, row: Row) -> list[Row]:
        """The row's prompt is stored and gave finite logits: its full pages are cached, and the
        waiting samples of its group that fit are forked from it (returned: running, prefilled)."""
        return self.sharing.prompt_done(row)
