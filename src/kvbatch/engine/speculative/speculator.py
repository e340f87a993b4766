"""What the engine asks of speculative decoding each step: the rows' proposals (and so the windows
the Scheduler reserves), and their verification."""
from __future__ import annotations

from typing import Optional

from kvbatch.engine.config import SpeculativeConfig
from kvbatch.engine.row import Row
from kvbatch.engine.runner import Decoded, Runner
from kvbatch.engine.speculative import Proposer
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
        """Read the pass in flight (Verifier.land); its rows too."""
        sent, self.inflight = self.inflight, None
        assert sent is not None, "land() without a pass in flight"
        return (*self.verifier.land(sent), sent.rows)

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
                "spec_passes_in_flight": self.passes_in_flight, **self.proposer.stats()}
