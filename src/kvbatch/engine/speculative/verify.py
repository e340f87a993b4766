"""The verification pass: every decoding row of the step, each with its last token and its proposed
tokens, a multi-token pass over the rows' cached pages with logits kept at every position. A forward
is right-padded to its longest window; where the rows that proposed nothing would pad enough
positions (`speculative.split_pass_tokens`) they run as a forward of their own, one token a row as a
decode step, and only the proposing rows run the window. The attention route decides how such a pass
reads the pages: with kv none in place, as a decode step does, each query over the keys up to its
own position (routes/dense.py `multi_plan`, routes/portable.py, routes/cuda.py `CudaMulti`). `dispatch`
builds a pass and hands it to the device, `land` reads it: at once (`step`), or, with the lookahead, by
the next engine step, which applies its outputs after it dispatched the next pass (engine.py `_land_pass`).

Each position is sampled exactly as a decode step at that output step would be: the same
controls, min_tokens masks at that step, and for sampled rows the key that step would use (the
row's key split once per output step, in order). A proposed token is accepted when the token
sampled at the position before it equals it; the first position whose token differs gives the
row's last token of the step. With a deterministic proposal (probability 1 on one token x) this
is speculative rejection sampling itself: x is accepted with probability p(x), and otherwise the
token is a draw from p with x removed, renormalized (the residual). With proposals drawn from a
draft's distribution q the kept token is still the model's own draw at each position, so outputs
keep the target distribution for any q; the draft draws with the same noise to agree often
(engine/speculative/draft.py). So a row's tokens for a seed are the tokens it gets without speculation.

After the pass, each row's stored length is cut back to its verified tokens and the pages past it
(holding only rejected tokens) go back to the pool, before any token reaches the output (so a row
that ends in this step caches only verified pages). The accepted tokens then reach the
OutputProcessor one output step at a time, as decode steps' tokens do (stop rules, logprobs).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, cast

import mlx.core as mx

from kvbatch.engine.mlx_lm_bridge import forward_hidden
from kvbatch.engine.row import Row
from kvbatch.engine.runner import Decoded, Runner, TokenPass
from kvbatch.engine.sampling import Sampled, sample_batch
from kvbatch.engine.speculative.chain import ChainState, accepted
from kvbatch.engine.speculative.ngram_device import DeviceNgramProposer
from kvbatch.engine.speculative.state import RowSpec

logger = logging.getLogger(__name__)


def accepted_prefix(sampled: list[int], proposal: list[int]) -> int:
    """How many proposed tokens are accepted: proposal[j] is while the token sampled at the
    position before it (sampled[j]) equals it, up to the first that differs."""
    a = 0
    while a < len(proposal) and sampled[a] == proposal[a]:
        a += 1
    return a


def key_chain(key: mx.array, n: int) -> tuple[list[mx.array], list[mx.array]]:
    """A sampled row's keys for its next n output steps (as its decode steps split them: the next
    key, this step's key) and its key after each of them."""
    use, after = [], []
    for _ in range(n):
        pair = mx.random.split(key)
        key = pair[0]
        after.append(key)
        use.append(pair[1])
    return use, after


def _forced(toks: list[int], offs: list[int], props: list[list[int]], share: float) -> list[int]:
    """EngineHooks.force_acceptance: the pass's tokens with each row's first int(share * k) positions
    holding its proposed tokens (kept as if sampled; the position after them keeps the model's draw)."""
    out = list(toks)
    for o, p in zip(offs, props):
        a = int(share * len(p))
        out[o:o + a] = p[:a]
    return out


@dataclass
class Pass:
    """A verification pass handed to the device: its rows (in the pass's order), their proposals, window
    lengths and first positions in the pass, their stored lengths before it, sampled rows' keys after each
    output step, and the pass's lazy logits, tokens and finite flags."""

    rows: list[Row]
    props: list[list[int]]
    lens: list[int]
    offs: list[int]
    before: list[int]
    afters: list[Optional[list[mx.array]]]
    logits: mx.array
    sampled: Sampled
    finite: mx.array
    t0: float
    state: Optional[ChainState] = None  # what a pass chained after this one is built from (chain.py)
    found: Optional[mx.array] = None  # a chained pass: its rows' proposals (B, k), -1 past each row's, unread
    next: Optional["Pass"] = None  # the pass chained after this one, in flight (its `before` set by this one's land)
    hist: Optional[list[int]] = None  # with `state`: each row's n-gram history length, the host's (chain.ChainState)
    longest: int = 0  # read: the most tokens a row's proposal had (a chained pass's: found, before its window cut it)


class Verifier:
    """Runs verification passes for the engine, and counts what they proposed and accepted."""

    def __init__(self, runner: Runner, split_tokens: Optional[int]):
        """split_tokens: speculative.split_pass_tokens (None: every row in one padded forward)."""
        self.r, self.split_tokens = runner, split_tokens
        self.passes = 0
        self.split_passes = 0  # passes whose rows without a proposal ran as a forward of their own
        self.proposed = 0
        self.accepted = 0

    def step(self, rows: list[Row], proposals: dict[int, list[int]]) -> Decoded:
        """Verify the proposals (by id(row); rows without one take part with their one token) of
        `rows` (their windows reserved); the accepted tokens as one TokenPass per output step."""
        sent = self.dispatch(rows, proposals, wait=True)
        return sent if isinstance(sent, Decoded) else self.land(sent)[0]

    def dispatch(self, rows: list[Row], proposals: dict[int, list[int]], wait: bool = False) -> Pass | Decoded:
        """Build the verification pass of `rows` (as `step`) and hand it to the device: the pass in flight,
        or the failed Decoded when it could not be built. wait: evaluate it now (else asynchronously)."""
        r, t0 = self.r, time.perf_counter()
        props = [proposals.get(id(row), []) for row in rows]
        lens = [1 + len(p) for p in props]
        plain = lens.count(1)
        # Where the rows without a proposal would pad enough window positions (speculative.split_pass_tokens)
        # they go first and take their one token through a forward of their own, a decode step's, so that only
        # the proposing rows pay for the window in every layer. Otherwise the rows keep the decode step's
        # order: the route then builds the pass's page table from the step before's (routes/common.py
        # PageTables), where another order costs a whole table (rows x pages) every pass.
        cut = plain if self.split_tokens is not None and 0 < plain < len(rows) and \
            plain * (max(lens) - 1) >= self.split_tokens else 0
        if cut:
            order = sorted(range(len(rows)), key=lambda i: lens[i] > 1)  # stable: each kind keeps its order
            rows, props, lens = [rows[i] for i in order], [props[i] for i in order], [lens[i] for i in order]
        offs, rep, steps, keys, afters = [], [], [], [], []
        sampled_rows = False
        for row, n in zip(rows, lens):
            offs.append(len(rep))
            rep += [row] * n
            m = len(row.out)
            steps.extend(range(m, m + n))
            key = row.sampler.key
            if key is None:
                keys += [None] * n
                afters.append(None)
            else:
                use, after = key_chain(key, n)
                keys += use
                afters.append(after)
                sampled_rows = True
        before = [row.kv.length for row in rows]
        groups = [(0, cut), (cut, len(rows))] if cut else [(0, len(rows))]
        self.split_passes += bool(cut)
        try:
            hidden, head = [], None
            for lo, hi in groups:
                h, head = self._forward(rows[lo:hi], props[lo:hi], lens[lo:hi])
                if hi < len(rows):
                    # the first forward's pool writes land before the second's are scheduled: a write
                    # behind a queued reader of the same pool copies the pool instead of updating it
                    mx.eval(h)
                hidden.append(h)
            assert head is not None
            logits = head(hidden[0] if len(hidden) == 1 else mx.concatenate(hidden)).astype(mx.float32)
            sampled = sample_batch(logits, rep, r.grammars, steps=steps, keys=keys if sampled_rows else None)
            finite = mx.isfinite(logits).all(axis=-1)
            (mx.eval if wait else mx.async_eval)(*sampled.arrays(), finite, *[k for a in afters if a for k in a])
        except Exception as e:
            return self._failed(rows, before, e)
        return Pass(rows, props, lens, offs, before, afters, logits, sampled, finite, t0)

    def chain(self, p: Pass, rows: list[Row], s: ChainState, lowest: list[int], proposer: DeviceNgramProposer,
              k: int, L: int) -> Optional[Pass]:
        """Build and dispatch the pass chained after `p` (in flight) over `rows` (p's that go on, and rows that
        join; their windows of L <= k + 1 tokens reserved), from s, their state (chain.py): each row's search
        finds up to k tokens, of which the first L - 1 are verified; lowest: the first position each window
        can have. The pass in flight, or None where the route cannot plan it or it could not be built
        (nothing then changed)."""
        r, t0 = self.r, time.perf_counter()
        held = [row.kv.length for row in rows]
        try:
            a = accepted(s.tokens, s.props)
            last = mx.take_along_axis(s.tokens, a[:, None], axis=1)
            pos = s.pos + a + 1
            found, hist = proposer.extend(s.slots, s.hist, s.tokens, a + 1, k, s.bound)
            props = found[:, :L - 1]
            inputs = mx.concatenate([last, mx.maximum(props, 0)], axis=1)
            if not r.begin_chained(rows, L, pos, lowest):
                return None
            try:
                h, head = forward_hidden(r.model, inputs, r.cache.views)
            finally:
                r.cache.end()
            logits = head(h.reshape(len(rows) * L, h.shape[-1])).astype(mx.float32)
            sampled = sample_batch(logits, [row for row in rows for _ in range(L)], r.grammars)
            finite = mx.isfinite(logits).all(axis=-1)
            state = ChainState(sampled.tokens.reshape(len(rows), L), props, pos, hist, s.slots, s.bound + L)
            mx.async_eval(*sampled.arrays(), finite, found, pos, hist, proposer.hist)
        except Exception:
            for row, n in zip(rows, held):
                row.kv.length = n
            logger.exception("chained verification pass of %d rows could not be built", len(rows))
            return None
        nxt = Pass(rows, [[] for _ in rows], [L] * len(rows), [i * L for i in range(len(rows))], [0] * len(rows),
                   [None] * len(rows), logits, sampled, finite, t0, state=state, found=found, hist=[0] * len(rows))
        p.next = nxt
        return nxt

    def _failed(self, rows: list[Row], before: list[int], e: Exception) -> Decoded:
        """A pass that failed: its rows' stored lengths back to where it started; nothing accepted."""
        for row, n in zip(rows, before):
            if not row.ended:
                row.kv.length = n
        logger.exception("verification pass of %d rows failed", len(rows))
        return Decoded([], f"{type(e).__name__}: {e}")

    def land(self, p: Pass) -> tuple[Decoded, dict[int, list[int]]]:
        """Read a pass's tokens (waiting for it): each row's stored length cut back to its verified tokens,
        its random stream advanced by the output steps it takes, and the pass's counts. Returns the accepted
        tokens as one TokenPass per output step, and by id(row) the tokens each row keeps (its accepted
        proposal and the token after it). A row that ended while the pass was in flight keeps nothing."""
        r, rows = self.r, p.rows
        try:
            toks, ok = cast(list[int], p.sampled.tokens.tolist()), cast(list[bool], p.finite.tolist())
            if p.found is not None:  # a chained pass's proposals: of each row's found tokens, those it verified
                found = [[t for t in f if t >= 0] for f in cast(list[list[int]], p.found.tolist())]
                p.props = [f[:n - 1] for f, n in zip(found, p.lens)]
                p.longest = max(map(len, found), default=0)
        except Exception as e:
            return self._failed(rows, p.before, e), {}
        force = r.hooks.force_acceptance
        if force is not None:
            toks = _forced(toks, p.offs, p.props, force)
            p.sampled.tokens = mx.array(toks)
        if p.found is None:
            p.longest = max(map(len, p.props), default=0)
        acc, kept = [], {}
        nxt = p.next
        # rows of a pass chained after this one keep its window past their kept tokens (chain.py)
        at_next = {id(row): j for j, row in enumerate(nxt.rows)} if nxt is not None else {}
        for i, row in enumerate(rows):
            if row.ended:  # its pages went back with its result; this pass's tokens are dropped
                acc.append(0)
                continue
            props = p.props[i]
            a = accepted_prefix(toks[p.offs[i]:p.offs[i] + p.lens[i]], props) if force is None \
                else int(force * len(props))
            acc.append(a)
            kept[id(row)] = toks[p.offs[i]:p.offs[i] + a + 1]
            j = at_next.get(id(row))
            if j is None:
                r.cache.rollback(row.kv, p.before[i] + a + 1)
            else:
                assert nxt is not None
                nxt.before[j] = p.before[i] + a + 1
                if p.hist is not None and nxt.hist is not None:
                    nxt.hist[j] = p.hist[i] + a + 1
                r.cache.rollback(row.kv, p.before[i] + a + 1 + nxt.lens[j])
            after = p.afters[i]
            if after is not None:
                row.sampler.key = after[a]  # the key after the a + 1 output steps it takes
            if props:
                if row.spec is None:  # (a row of a chained pass may not have proposed on the host yet)
                    row.spec = RowSpec()
                row.spec.verified(len(props), a)
                if force is not None:  # the benchmark's rows propose k tokens every step
                    row.spec.misses = row.spec.pause = 0
                    row.spec.want = 1 << 30
                self.proposed += len(props)
                self.accepted += a
        self.passes += 1
        if nxt is not None and nxt.state is not None and nxt.hist is not None:  # its histories' true bound now
            nxt.state = replace(nxt.state, bound=max(nxt.hist) + max(nxt.lens))
        return Decoded(self._by_step(rows, acc, p.offs, p.logits, p.sampled, p.finite, (toks, ok), p.t0)), kept

    def _forward(self, rows: list[Row], props: list[list[int]], lens: list[int]) -> tuple[mx.array, Callable]:
        """One forward of `rows`, each with its last token and its proposal (right-padded to the longest):
        the hidden states of the real positions, row after row (N, ·), and the vocab projection."""
        r, L = self.r, max(lens)
        inputs = mx.array([[row.out[-1]] + p + [0] * (L - n) for row, p, n in zip(rows, props, lens)])
        r.begin(rows, L, r.poison(rows), lens)
        try:
            h, head = forward_hidden(r.model, inputs, r.cache.views)
        finally:
            r.cache.end()
        h = h.reshape(len(rows) * L, h.shape[-1])
        if sum(lens) < len(rows) * L:
            h = h[mx.array([i * L + j for i, n in enumerate(lens) for j in range(n)])]
        return h, head

    @staticmethod
    def _by_step(rows: list[Row], acc: list[int], offs: list[int], logits: mx.array, sampled: Sampled,
                 finite: mx.array, read: tuple[list[int], list[bool]], t0: float) -> list[TokenPass]:
        """The pass's kept tokens as one TokenPass per output step (step j: the rows that keep a
        j-th token), for the OutputProcessor in order. read: every position's token and finite flag,
        read by the host once for the pass; each output step takes its rows' from there, where reading
        each step's gathered arrays would be a device round trip per output step."""
        toks, ok = read
        lp_at = {e: q for q, e in enumerate(sampled.lp_rows)} if sampled.lp_rows else {}
        out = []
        idx = list(range(len(rows)))
        for j in range(max(acc) + 1):
            if j:  # the rows that keep a j-th token: fewer at each step
                idx = [i for i in idx if acc[i] >= j]
            ent = [offs[i] + j for i in idx]
            sel = mx.array(ent)
            sub = Sampled(sampled.tokens[sel])
            lp_rows = [q for q, e in enumerate(ent) if e in lp_at] if lp_at else []
            if lp_rows:
                assert sampled.lp is not None and sampled.top_ids is not None and sampled.top_lps is not None
                at = mx.array([lp_at[ent[q]] for q in lp_rows])
                sub.lp_rows, sub.lp = lp_rows, sampled.lp[at]
                sub.top_ids, sub.top_lps = sampled.top_ids[at], sampled.top_lps[at]
                # now, while nothing else is queued: a pass in flight applies these after the next pass's dispatch
                mx.eval(sub.lp, sub.top_ids, sub.top_lps)
            out.append(TokenPass([rows[i] for i in idx], logits[sel], sub, finite[sel], t0,
                                 read=([toks[e] for e in ent], [ok[e] for e in ent])))
        return out

