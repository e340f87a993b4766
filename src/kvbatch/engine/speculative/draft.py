"""Draft-model proposals (speculative.method=draft): a second, smaller mlx-lm model with the same
tokenizer proposes each speculating row's next k tokens, one small decode step of all those rows
at a time, over its own paged KV cache (the same KV mode and page size as the model's).

The draft's cache is derived state: each row's draft pages hold a prefix of the row's tokens and,
after a step, the tokens it proposed. Before proposing, a row's stored tokens are compared with its
tokens now and cut back to what they share (a verification rejected the rest, or the row was not
verified); then the row catches up on what it lacks (the tokens a verification kept that the draft
never stored; everything, for a row that has no draft pages: admitted, forked from a sample,
resumed from a checkpoint or after a preemption) with prefill passes, the last of them giving its
first proposal. A row that leaves the batch (ends, is preempted, is cancelled) gives its draft
pages back at the next proposal. With engine.prefix_cache the draft's cache has its own prefix
cache: full pages of a row's own tokens stay cached when it leaves and after a long catch-up, so
a preempted row, the samples of one prompt and rows that begin alike take them instead of
computing them again.

Proposals are sampled as the model will sample that position: greedy rows take the draft's argmax;
a sampled row draws its j-th proposal with the same controls and the same Gumbel noise (the key of
that output step, engine/speculative/verify.py key_chain) that the model's draw at that output step
uses. The verifier keeps the model's own draw at each position (accepting a proposal while it equals
it), so a row's tokens are the model's whatever the draft proposes (the draft changes only how many
are accepted), and coupling the draft's draw to the same noise makes them agree wherever the two
distributions are close ("drafter-invariant" speculative decoding: Daliri, Musco and Suresh, 2024).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from kvbatch.engine.errors import KvbatchConfigError, RowError
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.kv.pages import CacheRow
from kvbatch.engine.mlx_lm_bridge import forward_hidden, pick_last
from kvbatch.engine.row import Row
from kvbatch.engine.sampling import sample_batch
from kvbatch.engine.speculative.verify import key_chain
from kvbatch.engine.types import ModelSpec

logger = logging.getLogger(__name__)

# a row at most this many tokens behind catches up in the step's first draft pass with the others (a
# verification leaves it one or two behind); further behind (admitted, resumed, paused), it catches
# up alone first, so the others' pass is not padded to its length
CATCH_UP_WITH_OTHERS = 16


def draft_model(method: str, tokenizer: Any, spec: ModelSpec, draft: Optional[tuple[nn.Module, Any, ModelSpec]]
                ) -> Optional[tuple[nn.Module, Any, ModelSpec]]:
    """The draft model (model, tokenizer, spec) method=draft proposes with, checked against the
    model's: the same vocabulary size (a draft's proposals and its draws are over the model's ids)
    and the same tokenizer. None for any other method. Raises KvbatchConfigError in one line."""
    if method != "draft":
        return None
    if draft is None:
        raise KvbatchConfigError("speculative.method='draft': no draft model was loaded (speculative.model names it)")
    d_tok, d_spec = draft[1], draft[2]
    if d_spec.vocab_size != spec.vocab_size:
        raise KvbatchConfigError(f"speculative.model={d_spec.name!r}: its vocabulary has {d_spec.vocab_size} ids, "
                                 f"the model's ({spec.name}) {spec.vocab_size}: a draft must share the model's "
                                 "tokenizer")
    if d_tok is not tokenizer and d_tok.get_vocab() != tokenizer.get_vocab():
        raise KvbatchConfigError(f"speculative.model={d_spec.name!r}: its tokenizer differs from the model's "
                                 f"({spec.name}): a draft must share the model's tokenizer")
    return draft


@dataclass(eq=False)
class DraftRow:
    """One row's claim on the draft's cache and the tokens it stored there, in order."""

    row: Row
    kv: CacheRow
    stored: list[int]
    sure: int = 0  # stored tokens known to be the row's own (its first `sure` tokens)


class DraftProposer:
    """Proposes with a draft model over its own paged cache (see the module docstring).

    kv_limit: the KV bytes the draft's pages may take now (the memory model's draft share);
    prefill_chunk: the most tokens of one row in one catch-up pass."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, kv_limit: Callable[[], int], prefill_chunk: int):
        self.model, self.cache = model, cache
        self.kv_limit, self.chunk = kv_limit, prefill_chunk
        self.rows: dict[int, DraftRow] = {}
        self.passes = 0  # draft forward passes
        self.cached_tokens = 0  # tokens rows took from the draft's prefix cache instead of computing them

    def stats(self) -> dict:
        """The draft's figures for summary.json: its forward passes, the prompt tokens rows took from its
        prefix cache, its pool's peak pages and bytes."""
        c = self.cache
        return {"spec_draft_passes": self.passes, "spec_draft_cached_tokens": self.cached_tokens,
                "spec_draft_peak_pages": c.pool.peak_in_use, "spec_draft_pool_bytes": c.capacity_bytes}

    def prepare(self, rows: list[Row], proposals: list[list[int]]) -> None:
        """Nothing ahead of the pass's tokens: the draft's next steps start from the tokens it keeps."""

    # ---- the draft's rows --------------------------------------------------------------------
    def forget(self, everything: bool = False) -> None:
        """Give back the draft pages of rows no longer running (everything: of every row)."""
        for rid, d in list(self.rows.items()):
            if everything or d.row.ended or not d.row.active:
                # its full pages of the row's own tokens stay cached (a preempted row resumes from them)
                self.cache.release(d.kv, tokens=None if everything else d.stored[:d.sure])
                del self.rows[rid]

    def _row(self, row: Row) -> DraftRow:
        """The row's draft state, its stored tokens cut back to the prefix they share with the
        row's tokens now (checked from `sure`: a row's tokens never change once they match)."""
        d = self.rows.get(id(row))
        if d is None:
            d = DraftRow(row, CacheRow(row.req.key), [])
            self.cache.admit(d.kv)
            self.rows[id(row)] = d
            seq = row.seq  # the cached pages of its prefix, up to its last token (fed: its logits propose)
            self.cache.take_cached(d.kv, self.cache.computed(d.kv, seq, (len(seq) - 1) // self.cache.P))
            d.stored = seq[:d.kv.length]
            d.sure = len(d.stored)
            self.cached_tokens += d.sure
            return d
        tail = _tokens_from(row, d.sure)[:-1]  # the row's last token is fed again: its logits give the proposal
        n = d.sure
        for a, b in zip(d.stored[d.sure:], tail):
            if a != b:
                break
            n += 1
        if n < len(d.stored):
            self.cache.rollback(d.kv, n)
            del d.stored[n:]
        d.sure = n
        return d

    # ---- proposals -----------------------------------------------------------------------------
    def propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens for rows[i] (a row whose draft pages cannot be had proposes nothing;
        a draft pass that fails costs this step's proposals and every row's draft pages, not the rows)."""
        try:
            return self._propose(rows, ks)
        except Exception:
            logger.exception("draft proposals for %d rows failed; the rows decode without them", len(rows))
            self.forget(everything=True)
            return [[] for _ in rows]

    def _propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        limit = self.kv_limit()
        live: list[tuple[int, DraftRow, list[int]]] = []  # (index, draft row, tokens to feed in the first pass)
        for i, row in enumerate(rows):
            d = self._row(row)
            todo = _tokens_from(row, len(d.stored))
            try:
                self.cache.reserve(d.kv, len(todo) + ks[i] - 1, limit)
            except RowError:
                self.cache.release(d.kv)
                del self.rows[id(row)]
                continue
            if len(todo) > CATCH_UP_WITH_OTHERS:  # a long way behind: alone, in chunks, up to its last token
                for a in range(0, len(todo) - 1, self.chunk):
                    self._forward([d], [todo[a:min(a + self.chunk, len(todo) - 1)]], want=False)
                todo = todo[-1:]
                d.sure = len(d.stored)  # the row's own tokens: its full pages cached for rows that begin alike
                self.cache.cache_pages(d.kv, d.stored, d.sure)
            live.append((i, d, todo))
        if not live:
            return out
        # the first pass: each row's remaining tokens, its first proposal from the last position
        keys = {i: key_chain(k, ks[i])[0] for i, _, _ in live if (k := rows[i].sampler.key) is not None}
        toks = self._forward([d for _, d, _ in live], [t for _, _, t in live], want=True,
                             steps=[len(rows[i].out) for i, _, _ in live],
                             keys=[keys[i][0] if i in keys else None for i, _, _ in live])
        for (i, _, _), t in zip(live, toks):
            out[i].append(t)
        # then one token a step for the rows that want more
        for j in range(1, max(ks[i] for i, _, _ in live)):
            more = [(i, d) for i, d, _ in live if ks[i] > j]
            toks = self._forward([d for _, d in more], [[out[i][-1]] for i, _ in more], want=True,
                                 steps=[len(rows[i].out) + j for i, _ in more],
                                 keys=[keys[i][j] if i in keys else None for i, _ in more])
            for (i, _), t in zip(more, toks):
                out[i].append(t)
        return out

    def _forward(self, ds: list[DraftRow], feed: list[list[int]], want: bool, steps: Optional[list[int]] = None,
                 keys: Optional[list] = None) -> list[int]:
        """One draft pass storing `feed` (right-padded) after each row's stored tokens; want: each
        row's token sampled from its last position's logits."""
        lens = [len(f) for f in feed]
        L = max(lens)
        inputs = mx.array([f + [0] * (L - len(f)) for f in feed])
        self.cache.begin([d.kv for d in ds], L, None, lens)
        try:
            h, head = forward_hidden(self.model, inputs, self.cache.views)
            if not want:
                mx.eval(self.cache.store.all_arrays())
                tokens: list[int] = []
            else:
                last = None if L == min(lens) else mx.array(lens) - 1
                logits = head(pick_last(h, last))[:, -1, :].astype(mx.float32)
                rows = [d.row for d in ds]
                use = keys if keys is not None and any(k is not None for k in keys) else None
                picked = sample_batch(logits, rows, steps=steps, keys=use).tokens
                mx.eval(picked, self.cache.store.all_arrays())
                tokens = picked.tolist()  # pyright: ignore[reportAssignmentType]
        finally:
            self.cache.end()
        for d, f in zip(ds, feed):
            d.stored += f
        self.passes += 1
        return tokens


def _tokens_from(row: Row, start: int) -> list[int]:
    """The row's tokens (prompt, then output) from position `start` on, without copying the rest."""
    prompt = row.req.prompt_tokens
    if start >= len(prompt):
        return row.out[start - len(prompt):]
    return prompt[start:] + row.out
