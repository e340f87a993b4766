"""What the engine asks of speculative decoding each step: the rows' proposals (and so the windows
the Scheduler reserves), and their verification."""
from __future__ import annotations

from typing import Optional

from kvbatch.engine.config import SpeculativeConfig
from kvbatch.engine.row import Row
from kvbatch.engine.runner import Decoded, Runner
from kvbatch.engine.speculative import Proposer
from kvbatch.engine.speculative.chain import concat, host_state, joined_state, select
from kvbatch.engine.speculative.ngram_device import DeviceNgramProposer
from kvbatch.engine.speculative.payoff import Payoff
from kvbatch.engine.speculative.state import RowSpec
from kvbatch.engine.speculative.verify import Pass, Verifier
from kvbatch.engine.speculative.window import max_proposal, speculates


class Speculator:
    """Proposes for the rows that may speculate and verifies them in one pass per step."""

    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer, runner: Runner, context_length: int,
                 page_size: int, quantized: bool, pipelined: bool):
        self.cfg, self.proposer = cfg, proposer
        self.verifier = Verifier(runner, cfg.split_pass_tokens)
        self.context_length, self.page_size, self.quantized = context_length, page_size, quantized
        self.payoff = Payoff(pipelined) if cfg.adaptive else None
        self.inflight: Optional[Pass] = None  # a pass dispatched and not yet read (`send`)
        self.older: Optional[Pass] = None  # the pass a chained pass was built from, until it is read (`chain`)
        self.chained = 0  # passes built from the pass before them on the device (`chain`)
        # a chained pass's window: one more than the longest proposal of the last pass read (at least one), so
        # that rows whose searches find fewer than k tokens do not verify k positions each
        self.width = cfg.num_tokens + 1
        self.passes_in_flight = 0  # passes left in flight by `send`

    def wants(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows proposes at all (speculative.disable_by_batch_size, then
        whether verifying pays at that batch: Payoff). Asked once a step, before its proposals: a step
        that does not propose runs as plain decode (the lookahead's, where the backend has it). Every
        step, the proposer first gives back what it held for rows no longer running (a draft's pages)."""
        self.proposer.forget()
        cap = self.cfg.disable_by_batch_size
        if cap is not None and rows > cap:
            return False
        return self.payoff is None or self.payoff.speculate(rows)

    def propose(self, rows: list[Row]) -> dict[int, list[int]]:
        """Proposed tokens by id(row), for the rows that propose this step (one `wants` allowed)."""
        out: dict[int, list[int]] = {}
        asked, ks = [], []
        for row in rows:
            if not speculates(row):
                continue
            if row.spec is None:
                row.spec = RowSpec()
            if not row.spec.may_propose():
                continue
            k = max_proposal(row, min(self.cfg.num_tokens, row.spec.want), self.context_length, self.page_size,
                             self.quantized)
            if k > 0:
                asked.append(row)
                ks.append(k)
        if asked:
            for row, p in zip(asked, self.proposer.propose(asked, ks)):
                if p:
                    out[id(row)] = p
        return out

    def verify(self, rows: list[Row], proposals: dict[int, list[int]]) -> Decoded:
        """One verification pass over `rows` (windows reserved), read now."""
        return self.verifier.step(rows, proposals)

    def send(self, rows: list[Row], proposals: dict[int, list[int]]) -> Decoded:
        """Dispatch a verification pass over `rows` and leave it in flight (`land` reads it), unless a row
        needs its tokens on the host before its next step (a grammar, penalties, forced tokens): then it is
        read now. The Decoded of what was read now (nothing, or the pass; or why it failed)."""
        sent = self.verifier.dispatch(rows, proposals)
        if isinstance(sent, Decoded):
            return sent
        if not all(speculates(row) for row in rows):
            return self.verifier.land(sent)[0]
        self.inflight = sent
        self.passes_in_flight += 1
        self.proposer.prepare(sent.rows, sent.props)  # while the device computes the pass
        return Decoded([])

    def land(self) -> tuple[Decoded, dict[int, list[int]], list[Row]]:
        """Read the oldest pass in flight (Verifier.land); its rows too."""
        if self.older is not None:
            sent, self.older = self.older, None
        else:
            sent, self.inflight = self.inflight, None
        assert sent is not None, "land() without a pass in flight"
        out = self.verifier.land(sent)
        self.width = 1 + min(self.cfg.num_tokens, max(sent.longest, 1))
        return (*out, sent.rows)

    def drop(self) -> None:
        """Forget the passes in flight unread (their rows ended or were cancelled)."""
        self.inflight = self.older = None

    def chainable(self, decoding: list[Row]) -> Optional[tuple[list[Row], int]]:
        """The rows of the pass chained after the one in flight and its window (tokens a row): those of the pass
        in flight still running, then the other rows that decode next (`decoding`: rows that have just finished
        their prompt, whose tokens the host holds), where such a pass can be built (chain.py: every row greedy
        with no per-step host state; the device n-gram search; no test hook that reads tokens); else None.
        A row of the pass in flight without room for a window past that pass's tokens at their most (near its
        max_tokens or the context) sits this pass out: once that pass is read it joins the next like a row whose
        prompt has just finished. The window is `width`, narrowed to what the joining rows have room for."""
        p, hooks = self.inflight, self.verifier.r.hooks
        if p is None or not self.cfg.chain or not isinstance(self.proposer, DeviceNgramProposer) \
                or hooks.force_acceptance is not None or hooks.nonfinite:
            return None
        flying = {id(row): n for row, n in zip(p.rows, p.lens) if not row.ended and row.active}
        width, rows, joined = self.width, [], []
        for row in [r for r in p.rows if id(r) in flying] + [r for r in decoding if id(r) not in flying]:
            s = row.sampler
            if s.key is not None or s.reasoning is not None or (s.min_tokens_ban is not None and
                                                                 len(row.out) < row.req.sampling.min_tokens):
                return None
            n = flying.get(id(row))  # its tokens in flight, at their most
            room = min(row.end_at, self.context_length - row.prompt_len) - len(row.out) - (n or 0)
            if n is None:
                joined.append(row)
                width = min(width, room)
            elif room >= self.width:
                rows.append(row)
        return (rows + joined, width) if rows and width >= 1 else None

    def chain(self, rows: list[Row], width: int) -> bool:
        """Dispatch the pass chained after the one in flight, over `rows` with windows of `width` tokens
        (`chainable`'s, reserved), before that one is read: it becomes the pass in flight, and `land` reads the
        older one next. False where it could not be built (nothing changed)."""
        p, proposer = self.inflight, self.proposer
        assert p is not None and isinstance(proposer, DeviceNgramProposer)
        at = {id(row): i for i, row in enumerate(p.rows)}
        keep = [at[id(row)] for row in rows if id(row) in at]
        joined = rows[len(keep):]  # (chainable puts the rows of the pass in flight first)
        if p.state is None:  # a pass built on the host: its state from the host's lists, the histories synced
            slots, hist = proposer.sync(rows[:len(keep)])
            s = host_state(p.sampled.tokens, [p.offs[i] for i in keep], [p.lens[i] for i in keep],
                           [p.props[i] for i in keep], [p.before[i] for i in keep], slots, hist)
            p.hist = [0] * len(p.rows)
            for i, n in zip(keep, hist):
                p.hist[i] = n
        else:
            s = select(p.state, keep)
        lowest = [p.before[i] + 1 for i in keep]
        known: list[tuple[int, int]] = []
        if joined:  # as if each had been in the pass in flight with its last token alone, kept
            slots, hist = proposer.sync(joined)
            known = [(row.kv.length, n) for row, n in zip(joined, hist)]
            s = concat(s, joined_state([row.out[-1] for row in joined], [b for b, _ in known], slots, hist,
                                       s.tokens.shape[1]))
            lowest += [b for b, _ in known]
        nxt = self.verifier.chain(p, rows, s, lowest, proposer, self.cfg.num_tokens, width)
        if nxt is None:
            return False
        assert nxt.hist is not None
        for j, (b, n) in enumerate(known, start=len(keep)):
            nxt.before[j], nxt.hist[j] = b, n
        self.older, self.inflight = p, nxt
        self.chained += 1
        self.passes_in_flight += 1
        return True

    def frees_slot(self) -> bool:
        """Whether a row of the pass in flight ends with it whatever its tokens (it gives each row one at least)."""
        sent = self.inflight
        return sent is not None and any(row.last_step for row in sent.rows if not row.ended)

    def record(self, rows: int, verified: bool, tokens: int, seconds: float) -> None:
        """A decode step ran (see Payoff.record)."""
        if self.payoff is not None:
            self.payoff.record(rows, verified, tokens, seconds)

    def stats(self) -> dict:
        """Totals for summary.json: tokens proposed and accepted, verification passes (those split, those left in
        flight while the host applied the pass before), acceptance rate."""
        v = self.verifier
        return {"spec_proposed": v.proposed, "spec_accepted": v.accepted, "spec_passes": v.passes,
                "spec_split_passes": v.split_passes,
                "spec_acceptance": v.accepted / v.proposed if v.proposed else None,
                "spec_plain_steps": self.payoff.plain_steps if self.payoff is not None else 0,
                "spec_passes_in_flight": self.passes_in_flight, "spec_passes_chained": self.chained,
                "spec_chain": self.cfg.chain and isinstance(self.proposer, DeviceNgramProposer),
                **self.proposer.stats()}
