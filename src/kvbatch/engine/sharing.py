"""Which rows share pages instead of computing them (vLLM v1's prefix caching, and `n` samples
of one prompt from one prefill), for the scheduler.

- **Prefix hits.** A row takes the cached pages its token sequence begins with, at admission
  and again before each prefill pass (a page another row finished meanwhile), and computes only
  the rest. Its last token is always computed: its logits give the first output token.
- **One computation of a shared page.** Before a pass, a row whose next page another running
  row (admitted earlier) is computing waits for it instead of computing it too; when that row's
  prompt is done, its pages are cached and the waiting row takes them. No cycle can form: a page
  has one computing row, and the first row in admission order never waits.
- **Forks.** Requests of one `group` (the samples of one prompt) are prefilled once: while the
  first admitted is prefilling, the others wait; when its prompt is done, each that fits is
  admitted as a fork: the full pages shared, the page being filled copied (kv.cache.fork), its
  first token sampled from the same logits with its own random stream.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Iterable, Optional

from kvbatch.engine.errors import RowError
from kvbatch.engine.kv import offload
from kvbatch.engine.kv.prefix import next_hash, prefix_hashes
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.row import Row

log = logging.getLogger(__name__)


class Sharing:
    """The scheduler's page sharing: prefix-cache hits, one computation of a shared page, and forks of a group's
    samples."""

    def __init__(self, sched: Any, cache: PagedKVCache):
        """sched: the Scheduler that owns this (its rows, pricing and admission)."""
        self.sched, self.cache, self.P = sched, cache, cache.P
        self.cached_tokens = 0  # tokens rows took from shared pages instead of computing them
        self.forks = 0
        self.restored_tokens = 0  # tokens rows loaded from their K/V files instead of computing them
        self.files_unused = 0  # K/V files that did not hold (the rows prefilled instead)
        self.restore_s = 0.0  # seconds spent reading, checking and placing those files' pages

    # ---- admission -------------------------------------------------------------------------
    def _leaders(self) -> dict[str, Row]:
        """group -> its running row whose prompt is being prefilled (the samples' first). Not a sample
        admitted with all but its last page cached: it computes one page, so the others of its group
        are admitted beside it (taking the same cached pages) rather than wait for it."""
        return {r.req.group: r for r in self.sched.running
                if r.req.group is not None and not r.out and r.prefilling
                and not (r.cached_tokens and r.target - r.kv.length <= self.P)}

    def first_admissible(self, waiting: Iterable[Row]) -> Optional[Row]:
        """The first waiting row that is not a sample waiting to be forked from its group's first."""
        leaders: Optional[dict[str, Row]] = None  # scanned only when a waiting sample needs it
        for r in waiting:
            lead = None
            if r.req.group is not None and not r.out:
                leaders = self._leaders() if leaders is None else leaders
                lead = leaders.get(r.req.group)
            if lead is None or lead.req.prompt_tokens != r.req.prompt_tokens:
                return r
        return None

    def _limit(self, row: Row) -> int:
        """Pages a row may take: all full pages before its last token (computed for its logits); none
        for a row that scores its prompt (prompt_logprobs needs every prompt position computed, as in vLLM);
        a scored text's row: the full pages before the position that predicts its first text token (the
        completions of one prompt share its pages, engine/scoring.py)."""
        if _scores_prompt(row):
            return 0
        if row.score is not None:
            return max(row.score.start - 1, 0) // self.P
        return (row.target - 1) // self.P

    def hit(self, row: Row) -> list[int]:
        """Cached pages the row's sequence begins with (not taken yet)."""
        return self.cache.computed(row.kv, row.seq, self._limit(row))

    def take(self, row: Row, pages: list[int]) -> None:
        """Give `row` the cached pages `pages` and count their tokens as cached."""
        if pages:
            self.cache.take_cached(row.kv, pages)
            self._count(row, len(pages) * self.P)

    def restore(self, row: Row) -> None:
        """A row admitted with its K/V pages on disk (Row.kv_file) continues with the full pages the file
        holds beyond its cached ones, loaded instead of computed (up to `_limit`: its last token is
        computed for its logits). A file that does not hold, or pages that cannot be had, are passed over
        with one log line: the row prefills them."""
        f, row.kv_file = row.kv_file, None
        limit = self._limit(row)
        if f is None or limit <= len(row.kv.pages):
            return
        t0 = time.perf_counter()
        try:
            rk, why = offload.load(f.path, self.cache.layout_id, f.identity, row.seq)
            if rk is not None:
                try:
                    n = self.cache.put_pages(row.kv, rk, min(rk.pages, limit), *self.sched.limits())
                    row.restored += n
                    self.restored_tokens += n
                    return
                except RowError as e:
                    why = f"no room for its pages ({e.message})"
                except (KeyError, ValueError, IndexError) as e:  # arrays of another shape under a valid checksum
                    why = f"its arrays do not fit ({type(e).__name__}: {e})"
        finally:
            self.restore_s += time.perf_counter() - t0
        self.files_unused += 1
        log.warning("row %s: its kept K/V in %s is not used (%s); its tokens are prefilled", row.req.key, f.path, why)

    def _count(self, row: Row, n: int) -> None:
        self.cached_tokens += n
        if not row.preemptions:  # a row's own stat: its prompt, at its first admission
            row.cached_tokens = min(row.cached_tokens + n, row.prompt_len)

    # ---- prefill ---------------------------------------------------------------------------
    def before_prefill(self, prefilling: list[Row]) -> set[int]:
        """Before a prefill pass: every prefilling row (in admission order) takes the cached pages that
        continue it; returns the ids of rows that wait for a page an earlier row is computing."""
        if not self.cache.prefix_cache:
            return set()
        owners: dict[bytes, Row] = {}
        waits: set[int] = set()
        # page hashes chain, so two rows share a page only if they share their first page too: a row whose first
        # page no other prefilling row has neither waits nor computes a page for another (at 1,024 rows of
        # distinct prompts this skips hashing every row's every page each pass)
        heads = [prefix_hashes(r.kv, r.seq, self.P, 1)[0] if r.target >= self.P else None for r in prefilling]
        firsts = Counter(heads)
        for r, h0 in zip(prefilling, heads):  # admission order: the earlier row computes a shared page
            seq, limit = r.seq, self._limit(r)
            self.take(r, self.cache.computed(r.kv, seq, limit))
            if h0 is None or firsts[h0] < 2:
                continue
            h = next_hash(r.kv, seq, self.P, limit)
            if h is not None and h in owners:
                waits.add(id(r))
                continue
            for h in prefix_hashes(r.kv, seq, self.P, r.target // self.P):  # cached when its prompt is done
                owners.setdefault(h, r)
        return waits

    def prompt_done(self, row: Row) -> list[Row]:
        """The row's prefill is complete and gave finite logits: its full pages are cached, and the
        waiting samples of its group that fit are forked from it (returned, running, prefilled)."""
        self.cache.cache_pages(row.kv, row.seq, row.kv.length)
        if row.req.group is None or row.out:
            return []
        s, P = self.sched, self.P
        full = row.kv.length // P
        chosen: list[Row] = []
        for r in s.waiting:
            if len(s.running) >= s.max_batch:
                break
            if r.req.group != row.req.group or r.out or r.req.prompt_tokens != row.req.prompt_tokens \
                    or (_scores_prompt(r) and not _scores_prompt(row)) or s.refusal(r):
                continue
            r.target = r.prompt_len
            if not s.admits(r, (len(chosen) + 1) * full):  # the pages each chosen fork will share
                break
            s.start(r)
            chosen.append(r)
        limits = s.limits()  # every chosen fork counted: one pool growth makes room for all of them
        forks = []
        for i, r in enumerate(chosen):
            try:
                self.cache.fork(row.kv, r.kv, *limits)
            except RowError:
                for x in chosen[i:]:  # back to waiting, where they still are
                    s.running.remove(x)
                    self.cache.release(x.kv)
                    x.active = False
                break
            s.waiting.remove(r)
            if r.logprobs is not None and r.logprobs.prompt is not None and row.logprobs is not None \
                    and row.logprobs.prompt is not None:  # the same prompt: the same prompt log-probabilities
                r.logprobs.prompt = list(row.logprobs.prompt)
            self._count(r, r.prompt_len)
            self.forks += 1
            forks.append(r)
        return forks


def _scores_prompt(row: Row) -> bool:
    return row.logprobs is not None and row.logprobs.prompt is not None
