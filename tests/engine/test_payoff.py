"""speculative.adaptive: a step speculates while steps that verify proposals give at least the output tokens
a second of steps that do not, per batch-size band (engine/speculative/payoff.py). Costs come from clocks
moved by hand: the same decisions on any machine."""
from __future__ import annotations

import pytest


from kvbatch.engine import Engine
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.speculative.payoff import LEARN_EVERY, MIN_STEPS, PIPELINED_RUN, PROBE_EVERY, Payoff
from kvbatch.engine.testing import engine_config
from kvbatch.engine.types import Request, SamplingParams
from tests.engine.test_speculative import _requests, _same, prompts


def _run(p: Payoff, rows: int, steps: int, verify_rate: float, plain_rate: float) -> list[bool]:
    """`steps` decisions for `rows` rows, each step recorded at the rate of the mode it ran (tokens a second)."""
    out = []
    for _ in range(steps):
        go = p.speculate(rows)
        out.append(go)
        p.record(rows, go, rows * 2, rows * 2 / (verify_rate if go else plain_rate))
    return out


def test_both_modes_measured_first_then_the_faster_with_one_probe_in_every_probe_every():
    p = Payoff()
    got = _run(p, 64, MIN_STEPS * 2 + 3 * PROBE_EVERY, verify_rate=50.0, plain_rate=100.0)
    assert got[:MIN_STEPS] == [True] * MIN_STEPS and got[MIN_STEPS:2 * MIN_STEPS] == [False] * MIN_STEPS
    after = got[2 * MIN_STEPS:]
    assert after.count(True) == 3 and all(after[i] for i in range(PROBE_EVERY - 1, len(after), PROBE_EVERY))
    assert p.plain_steps == got.count(False)

    p = Payoff()  # verifying faster: it keeps speculating, plain runs once in every PROBE_EVERY
    after = _run(p, 64, MIN_STEPS * 2 + 3 * PROBE_EVERY, verify_rate=150.0, plain_rate=100.0)[2 * MIN_STEPS:]
    assert after.count(False) == 3


def test_one_slow_step_does_not_decide_a_band():
    """The first verification pass of a shape compiles kernels on a GPU: seconds where the others take
    milliseconds. A band's rates are medians of recent steps, so that one step leaves verifying chosen
    where it pays (a sum over the steps would keep it plain for a hundred steps)."""
    p = Payoff()
    out = []
    for i in range(80):
        go = p.speculate(64)
        out.append(go)
        seconds = 128 / (150.0 if go else 100.0) * (100 if i == 0 else 1)  # step 0: the compile
        p.record(64, go, 128, seconds)
    assert out[:MIN_STEPS] == [True] * MIN_STEPS
    assert out[2 * MIN_STEPS:].count(True) >= len(out) - 2 * MIN_STEPS - 3  # verifying, but the probes


def test_each_batch_size_band_decides_for_itself():
    p = Payoff()
    small = _run(p, 4, 40, verify_rate=300.0, plain_rate=100.0)  # memory-bound: verifying pays
    large = _run(p, 1000, 40, verify_rate=60.0, plain_rate=100.0)  # compute-bound: it does not
    assert small[-30:].count(True) >= 29 and large[-30:].count(False) >= 29
    assert _run(p, 5, 1, verify_rate=300.0, plain_rate=100.0) == [True]  # 4 and 5 rows: one band
    assert _run(p, 700, 1, verify_rate=60.0, plain_rate=100.0) == [False]  # 700 and 1,000: one band (512-1,023)


def test_a_change_in_the_rates_is_followed_through_the_probes():
    p = Payoff()
    _run(p, 64, 40, verify_rate=150.0, plain_rate=100.0)
    got = _run(p, 64, 4 * PROBE_EVERY, verify_rate=150.0, plain_rate=400.0)  # plain decode got 4x faster
    assert got[-PROBE_EVERY + 1:].count(True) <= 1  # by the probes, the choice moved to plain


def _pipelined_job(p: Payoff, rows: int, steps: int, plain: float, verify: float, refill: float,
                   ) -> tuple[list[bool], float]:
    """`steps` decisions for `rows` rows, each recorded at what it costs in a pipelined decode loop: a plain
    step (`rows` tokens) `plain` seconds in a run of plain steps and `plain + refill` as the first after a pass
    (nothing to hide its host work behind), a verification pass (2.15 x `rows` tokens) `verify` seconds.
    The decisions, and the job's output tokens a second."""
    got, last, spent, made = [], True, 0.0, 0
    for _ in range(steps):
        go = p.speculate(rows)
        tokens, seconds = (round(2.15 * rows), verify) if go else (rows, plain + (refill if last else 0.0))
        p.record(rows, go, tokens, seconds)
        got.append(go)
        last, spent, made = go, spent + seconds, made + tokens
    return got, made / spent


def test_pipelined_plain_decode_is_measured_in_runs_and_chosen_where_it_runs_faster():
    """With the lookahead a lone plain step between passes costs its host and device work end to end, while a
    run of them overlaps the two. A job's batch grows from a few rows, where verifying pays, and each larger
    band starts from its neighbour's choice. At 512 rows here a plain step costs 1.0 s in a run and 2.0 s alone,
    a pass gives 2.15x a step's tokens in 2.6 s: measured one step at a time, plain looks slower than verifying
    (256 against 423 tokens a second), so the band keeps verifying; measured in runs, the first after a pass not
    counted, it moves to plain and the job runs within 10% of plain decode's 512 tokens a second (probing
    verification a run of PIPELINED_RUN steps in every PROBE_EVERY x PIPELINED_RUN)."""
    rates = {}
    for pipelined in (False, True):
        p = Payoff(pipelined=pipelined)
        for rows in (4, 8, 16, 32, 64, 128, 256):  # rows joining: verifying pays at each of these
            _pipelined_job(p, rows, 24, plain=1.0, verify=1.0, refill=1.0)
        rates[pipelined] = _pipelined_job(p, 512, 400, plain=1.0, verify=2.6, refill=1.0)
    (alone, alone_rate), (runs, runs_rate) = rates[False], rates[True]
    assert alone[-200:].count(True) > 190 and alone_rate < 440
    assert runs[-200:].count(False) > 160 and runs_rate > 0.9 * 512
    assert runs[-200:].count(True) <= 2 * PIPELINED_RUN  # measured itself: a probe's run once in 128 steps
    probes = [i for i in range(200, 396) if runs[i] and not runs[i - 1]]  # each probe of verifying: a run
    assert probes and all(runs[i:i + PIPELINED_RUN] == [True] * PIPELINED_RUN for i in probes)

    got, rate = _pipelined_job(Payoff(pipelined=True), 512, 400, plain=1.0, verify=1.5, refill=1.0)
    assert got[-200:].count(True) > 160 and rate > 1100 / 1.5 * 0.85  # where verifying pays in a run, it stays


class _CostClock:
    """A clock that moves, at each reading, by the cost of what ran since the reading before: `verify`
    seconds when a verification pass ran, `plain` seconds otherwise."""

    def __init__(self, verify: float, plain: float):
        self.verify, self.plain, self.t, self.passes = verify, plain, 0.0, 0
        self.eng: Engine | None = None

    def __call__(self) -> float:
        passes = self.eng.speculator.verifier.passes if self.eng and self.eng.speculator else 0
        self.t += self.verify if passes > self.passes else self.plain
        self.passes = passes
        return self.t


def _engine(m, clock: _CostClock | None, adaptive: bool = True, lookahead: str = "auto") -> Engine:
    model, tok, spec = m
    cfg = engine_config(page_size=16, max_batch=4, memory_budget=2 << 30, allow_unvalidated=True,
                        speculative={"method": "ngram", "num_tokens": 4, "adaptive": adaptive} if clock else None,
                        options=EngineOptions(lookahead=lookahead))
    eng = Engine(model, tok, spec, cfg, hooks=EngineHooks(clock=clock) if clock else None)
    if clock:
        clock.eng = eng
    return eng


def test_an_engine_stops_verifying_where_it_costs_more_and_keeps_where_it_pays_same_tokens(tiny_model):
    m = tiny_model()
    ref = _engine(m, None).generate(_requests(max_tokens=60))
    slow = _engine(m, _CostClock(verify=10.0, plain=1.0))  # a pass costs 10 steps: plain decode is faster
    _same(ref, slow.generate(_requests(max_tokens=60)))
    s = slow.summary()
    assert not slow.speculator.payoff.pipelined  # the CPU's loop reads each step: a lone step costs what it does
    assert s["spec_plain_steps"] > 2 * s["spec_passes"] and s["spec_accepted"] > 0
    fast = _engine(m, _CostClock(verify=1.0, plain=10.0))  # a pass costs what a step does: verifying pays
    _same(ref, fast.generate(_requests(max_tokens=60)))
    f = fast.summary()
    assert f["spec_passes"] > 2 * f["spec_plain_steps"] and f["spec_passes"] > s["spec_passes"]
    fixed = _engine(m, _CostClock(verify=10.0, plain=1.0), adaptive=False)  # off: every step may propose
    _same(ref, fixed.generate(_requests(max_tokens=60)))
    assert fixed.summary()["spec_plain_steps"] == 0 and fixed.summary()["spec_passes"] >= f["spec_passes"]


def test_steps_kept_plain_keep_the_lookahead_and_passes_land_it_first(tiny_model):
    """With the lookahead (the GPU backends' decode loop; on here by hand), a speculating engine decodes the
    steps it keeps plain with a step in flight, and a step that proposes lands that step first (its
    proposals read every row's tokens): the tokens are those without speculation, kept plain or verified,
    adaptive or fixed, greedy or sampled (each seed's own stream through both kinds of step), and plain
    steps' costs reach the payoff."""
    m = tiny_model()
    for sampled in (False, True):
        def reqs():
            greedy = _requests(max_tokens=60)
            if not sampled:
                return greedy
            return _requests(3, temperature=1.0, top_k=2) + [
                Request(f"t{i}", p, SamplingParams(max_tokens=40, temperature=0.15, seed=10 + i))
                for i, p in enumerate(prompts(3))]
        ref = _engine(m, None, lookahead="off").generate(reqs())
        inflight = []
        slow = _engine(m, _CostClock(verify=10.0, plain=1.0), lookahead="on")
        slow.hooks.on_decode_step = lambda: inflight.append(slow.stepper.inflight)
        _same(ref, slow.generate(reqs()))
        s = slow.summary()
        assert s["lookahead"] and s["spec_plain_steps"] > 2 * s["spec_passes"] > 0 and s["spec_accepted"] > 0
        assert sum(inflight) > s["spec_plain_steps"] // 2  # plain steps left their step in flight
        assert sum(b.plain.steps for b in slow.speculator.payoff.bands.values()) > 0
        assert slow.speculator.payoff.pipelined  # measured in runs (test_pipelined_plain_decode_...)
        for adaptive in (True, False):
            fast = _engine(m, _CostClock(verify=1.0, plain=10.0), adaptive=adaptive, lookahead="on")
            _same(ref, fast.generate(reqs()))
            f = fast.summary()
            assert f["spec_passes"] > f["spec_plain_steps"] and f["spec_accepted"] > 0


def test_a_band_entered_later_starts_from_its_neighbours_choice_and_learns_its_own():
    p = Payoff()
    _run(p, 64, 20, verify_rate=110.0, plain_rate=100.0)  # 64-127 rows: verifying pays, narrowly
    got = _run(p, 40, 3 * LEARN_EVERY + 10, verify_rate=50.0, plain_rate=100.0)  # 32-63 rows: it does not
    assert got[:LEARN_EVERY - 1] == [True] * (LEARN_EVERY - 1)  # the neighbour's choice, no steps spent measuring
    assert got[-10:] == [False] * 10  # its own, measured through a probe every LEARN_EVERY steps

    p = Payoff()
    _run(p, 64, 20, verify_rate=300.0, plain_rate=100.0)  # 3x: a clear verdict
    got = _run(p, 40, PROBE_EVERY, verify_rate=300.0, plain_rate=100.0)
    assert got.count(False) == 1  # trusted: one probe in PROBE_EVERY, none of the warm-up's plain steps
    assert _run(p, 4, MIN_STEPS + 1, verify_rate=300.0, plain_rate=100.0)[:MIN_STEPS] == [True] * MIN_STEPS
    assert p.bands[3].plain.steps == 1  # a band far from any measured one measures both itself


@pytest.mark.parametrize("lookahead", ["off", "on"])
def test_a_draft_model_follows_rows_through_steps_kept_plain(tiny_model, lookahead):
    """speculative.method=draft: the draft's own cache catches up on the tokens of steps the payoff kept plain
    (its proposals after them are still accepted), and the tokens are those without speculation; with the
    lookahead too (plain steps with a step in flight)."""
    m, draft = tiny_model(), tiny_model()  # the model as its own draft: every proposal it makes is right
    model, tok, spec = m
    clock = _CostClock(verify=1.0, plain=1.0)  # a close call: plain steps and passes alternate in probes
    cfg = engine_config(page_size=16, max_batch=4, memory_budget=2 << 30, allow_unvalidated=True,
                        speculative={"method": "draft", "num_tokens": 4}, options=EngineOptions(lookahead=lookahead))
    eng = Engine(model, tok, spec, cfg, hooks=EngineHooks(clock=clock), draft=draft)
    clock.eng = eng
    _same(_engine(m, None).generate(_requests(max_tokens=60)), eng.generate(_requests(max_tokens=60)))
    s = eng.summary()
    assert s["spec_plain_steps"] > 0 and s["spec_accepted"] == s["spec_proposed"] > 0
