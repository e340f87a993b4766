"""Admission under a memory budget (issues 6, 23), in three parts (--parts; merged from admission.py and
memory_admission.py):

- `optimistic`: long outputs under a fixed budget, `engine.admission=optimistic` against `reserve`, side by
  side. Every row may generate up to --max-tokens, but answers end at lengths spread over a long tail
  (log-normal, median --median, capped at --max-tokens): the end is set by a test hook (the row is
  teacher-forced with tokens of that length: EngineHooks.force), the same lengths on both sides. The budget
  is the weights plus room for --fit rows at their worst case, so `reserve` runs --fit rows at a time while
  `optimistic` runs as many as their current lengths allow and preempts when growth cannot fit. Per round
  (order alternating): wall time, preemptions, peak concurrency, whether every row came back once with its
  tokens. Model: --model, default tiny-16l.
- `modes`: with a fixed KV budget (--kv-budget, 1 GiB), how many concurrent rows of --row-tokens tokens each
  KV mode admits: the arithmetic (budget // one row's worst-case KV pages), and the real Engine's admission
  with budget = weights + workspace + growth copy + the KV budget (--submit rows, one admission round).
  Model: --model, default smollm2.
- `long`: --rows rows x --new tokens (EOS off, greedy) with kv=q8 under a budget equal to the plan for those
  rows at once, so the pool starts empty and grows several times; progress to --log every --every seconds.
  Reported: all rows finished, growth events, peak RSS (getrusage, and psutil sampled), MLX peak, budget,
  weights, and the plan's predictions. Model: --model, default smollm2.

    python -m benchmarks engine.admission --parts optimistic --out benchmarks/results/engine/admission.json
    python -m benchmarks engine.admission --parts modes
    python -m benchmarks engine.admission --parts long --rows 8 --new 8000 --log /tmp/ma_long.log
"""
from __future__ import annotations

import json
import math
import random
import resource
import statistics
import sys
import threading
import time

import mlx.core as mx

from benchmarks import harness as h
from kvbatch.engine.memory import MemoryModel, format_plan, kv_layout
from kvbatch.engine.sizes import fmt_bytes, parse_size
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--parts", "optimistic,modes,long", "--model", "tiny", "--rows", "4", "--max-tokens", "24", "--median", "6",
         "--fit", "2", "--max-batch", "4", "--rounds", "2", "--kv-budget", "1MiB", "--row-tokens", "64", "--submit",
         "4", "--new", "20", "--every", "0.1"]


def add_args(ap) -> None:
    ap.add_argument("--parts", default="optimistic", help="optimistic,modes,long")
    ap.add_argument("--model", default="", help="default: tiny-16l (optimistic), smollm2 (modes, long)")
    ap.add_argument("--rows", type=int, default=0, help="optimistic: rows (default 64); long: rows (default 8)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="optimistic")
    ap.add_argument("--median", type=int, default=200, help="optimistic: median answer length")
    ap.add_argument("--sigma", type=float, default=1.0, help="optimistic")
    ap.add_argument("--fit", type=int, default=4, help="optimistic: rows whose worst case fits the budget")
    ap.add_argument("--max-batch", type=int, default=64, help="optimistic")
    ap.add_argument("--kv", default="none", help="optimistic: KV mode")
    ap.add_argument("--rounds", type=int, default=2, help="optimistic")
    ap.add_argument("--kv-budget", default="1GiB", help="modes")
    ap.add_argument("--row-tokens", type=int, default=4096, help="modes")
    ap.add_argument("--submit", type=int, default=64, help="modes: rows submitted")
    ap.add_argument("--new", type=int, default=8000, help="long")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="long: budget = plan for the rows x this")
    ap.add_argument("--every", type=float, default=30.0, help="long: progress every this many seconds")
    ap.add_argument("--log", default="", help="long: progress to this file (default: stdout)")


# --- optimistic against reserve ---------------------------------------------------------------------------

def _optimistic_run(m, admission: str, budget: int, reqs: list[Request], forced: dict, a) -> dict:
    model, tok, spec = m
    eng = h.engine(model, tok, spec, a.kv, page_size=16, max_batch=a.max_batch, memory_budget=budget,
                   admission=admission)
    for k, f in forced.items():
        eng.hooks.force(k, f, capture=False)
    t0 = time.perf_counter()
    res = eng.generate(reqs)
    wall = time.perf_counter() - t0
    s = eng.summary()
    ok = all(r.ok and r.tokens == forced[r.key] for r in res) and len({r.key for r in res}) == len(reqs)
    return {"admission": admission, "wall_s": wall, "rows_ok_and_exact": ok, "preemptions": s["preemptions"],
            "peak_concurrency": s["peak_concurrency"], "tokens": sum(len(r.tokens) for r in res),
            "prefill_s": s["prefill_s"], "decode_s": s["decode_s"], "prefill_tokens": s["prefill_tokens_total"],
            "peak_kv_pool_bytes": s["peak_capacity_pages"] * h.page_bytes(eng),
            "kv_room_bytes": budget - spec.weights_bytes}


def optimistic(a) -> dict:
    m = h.load(a.model or "tiny-16l")
    rows, vocab = a.rows or 64, min(m[2].vocab_size, 4000)
    rnd = random.Random(5)
    lengths = [min(a.max_tokens, max(1, int(rnd.lognormvariate(math.log(a.median), a.sigma)))) for _ in range(rows)]
    prompts = [[(7 * i + 3 * j) % vocab + 1 for j in range(rnd.randint(16, 200))] for i in range(rows)]
    forced = {f"r{i}": [(11 * i + 5 * j) % vocab + 1 for j in range(n)] for i, n in enumerate(lengths)}
    reqs = h.requests(prompts, a.max_tokens, "r")
    probe = h.engine(m[0], m[1], m[2], a.kv, page_size=16, max_batch=a.max_batch, memory_budget=2 << 30)
    budget = h.bytes_for(probe, [max(map(len, prompts)) + a.max_tokens] * a.fit, max(map(len, prompts)))
    del probe
    sides = {name: (lambda name=name: _optimistic_run(m, name, budget, reqs, forced, a))
             for name in ("reserve", "optimistic")}
    runs = h.alternate(sides, a.rounds, after=mx.clear_cache, log=False)
    speedups = [r["wall_s"] / o["wall_s"] for r, o in zip(runs["reserve"], runs["optimistic"])]
    out = {"budget_bytes": budget, "median_speedup": statistics.median(speedups), "speedups": speedups,
           "lengths": {"median": statistics.median(lengths), "max": max(lengths), "mean": statistics.mean(lengths)},
           "runs": runs}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}), flush=True)
    return out


# --- rows per KV mode -------------------------------------------------------------------------------------

def modes(a) -> list[dict]:
    model, tok, spec = h.load(a.model or "smollm2")
    kv_budget, row_tokens = parse_size(a.kv_budget), a.row_tokens
    prompt = tok.encode("Write a very long essay about the history of the printing press.")
    rows = []
    for mode in ("none", "q8", "q4"):
        lay = kv_layout(spec, mode, a.page_size, a.group_size)
        row_kv = lay.pages_for(row_tokens) * lay.page_bytes
        arithmetic = kv_budget // row_kv
        probe = MemoryModel(spec, lay, 0, 512, 64)
        # budget = weights + workspace (for `arithmetic` rows) + growth copy + the fixed KV budget
        budget = (spec.weights_bytes + kv_budget + probe.growth_transient(kv_budget)
                  + probe.workspace(max(arithmetic, 1), row_tokens, len(prompt)))
        eng = h.engine(model, h.NoEos(tok), spec, mode, page_size=a.page_size, group_size=a.group_size,
                       max_batch=64, memory_budget=budget)
        for i in range(a.submit):
            eng.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=row_tokens - len(prompt))))
        eng.step()  # one admission round (every row that fits starts and is prefilled), one decode step
        admitted = h.running_rows(eng)
        eng.cancel()
        # the same fixed budget with the workspace taken out of it (total = weights + the KV budget)
        total_only = MemoryModel(spec, lay, spec.weights_bytes + kv_budget, 512, 64).rows_that_fit(
            row_tokens, len(prompt))
        r = {"kv_mode": mode, "bytes_per_token": lay.bytes_per_token, "row_kv_bytes": row_kv,
             "rows_arithmetic": arithmetic, "engine_budget": budget, "rows_admitted_engine": admitted,
             "rows_fit_total_weights_plus_kv_budget": total_only, "plan": eng.plan_line(row_tokens, len(prompt))}
        print(json.dumps(r), flush=True)
        rows.append(r)
    base = rows[0]["rows_admitted_engine"]
    for r in rows:
        r["ratio_vs_none"] = r["rows_admitted_engine"] / base if base else None
    return rows


# --- a long run that grows the pool -------------------------------------------------------------------------

def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


TEXTS = ["Tell me a long story about a lighthouse keeper.", "Explain how a steam engine works, in detail.",
         "Write a travel diary of a journey across Siberia.", "Describe the life cycle of a star.",
         "Write a long letter from a sailor to his sister.", "Explain the rules of chess to a child.",
         "Write the history of a small mountain village.", "Describe a day in a medieval monastery."]


class RssSampler(threading.Thread):
    """The process's RSS, sampled every 0.2 s: its peak."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = _rss(), threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.2)


def _progress(eng, t0: float, rate: float) -> str:
    pool = h.kv_pool(eng)
    return (f"{time.perf_counter() - t0:8.0f}s tokens={h.generated_tokens(eng)} ({rate:.1f} tok/s now) "
            f"running={h.running_rows(eng)} pool={pool['capacity_pages']}p/{fmt_bytes(pool['capacity_bytes'])} "
            f"in_use={pool['in_use']}p growths={pool['growths']} rss={fmt_bytes(_rss())} "
            f"mx_active={fmt_bytes(mx.get_active_memory())} mx_peak={fmt_bytes(mx.get_peak_memory())}")


def long_run(a) -> dict:
    model, tok, spec = h.load(a.model or "smollm2")
    rows, new = a.rows or 8, a.new
    prompts = [tok.encode(TEXTS[i % len(TEXTS)]) for i in range(rows)]
    worst = [min(len(p) + new, spec.context_length) for p in prompts]
    lay = kv_layout(spec, "q8", a.page_size, a.group_size)
    max_prompt = max(len(p) for p in prompts)
    budget = int(MemoryModel(spec, lay, 0, 512, rows).bytes_for(worst, max_prompt) * a.budget_scale)
    eng = h.engine(model, h.NoEos(tok), spec, "q8", page_size=a.page_size, group_size=a.group_size, max_batch=rows,
                   memory_budget=budget)
    plan = eng.plan(max(worst), max_prompt)
    predicted_total = h.bytes_for(eng, worst, max_prompt)
    predicted_kv = sum(lay.pages_for(w) for w in worst) * lay.page_bytes
    out = {"rows": rows, "new": new, "prompt_tokens": [len(p) for p in prompts], "budget": budget,
           "weights": spec.weights_bytes, "plan": plan, "plan_line": format_plan(plan),
           "predicted_total": predicted_total, "predicted_kv": predicted_kv, "rss_before": _rss(),
           "maxrss_before": _maxrss()}
    logf = open(a.log, "a") if a.log else sys.stdout
    sampler = RssSampler()
    sampler.start()
    mx.clear_cache()
    mx.reset_peak_memory()
    print(f"start {time.strftime('%H:%M:%S')} {out['plan_line']} budget={budget}", file=logf, flush=True)
    for i, p in enumerate(prompts):
        eng.add(Request(f"row{i}", p, SamplingParams(max_tokens=new)))
    t0 = last = time.perf_counter()
    last_tok, results = 0, []
    while eng.has_unfinished():  # step by step, so progress can be logged between steps
        results += eng.step()
        if time.perf_counter() - last >= a.every:
            now, done = time.perf_counter(), h.generated_tokens(eng)
            print(_progress(eng, t0, (done - last_tok) / max(now - last, 1e-9)), file=logf, flush=True)
            last, last_tok = now, done
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    out.update(_long_result(eng, results, wall, rows, new, sampler.peak, lay))
    out["checks"] = {
        "mx_peak <= budget": out["mx_peak"] <= budget,
        "rss_peak_sampled <= budget + weights": out["rss_peak_sampled"] <= budget + spec.weights_bytes,
        "maxrss <= budget + weights": out["maxrss_after"] <= budget + spec.weights_bytes,
        "predicted_kv / peak_kv_in_use": predicted_kv / max(out["peak_kv_bytes_in_use"], 1),
        "predicted_total / mx_peak": predicted_total / max(out["mx_peak"], 1)}
    print(f"done {wall:.0f}s " + json.dumps(out["checks"]), file=logf, flush=True)
    return out


def _long_result(eng, results, wall: float, rows: int, new: int, rss_peak: int, lay) -> dict:
    s = eng.summary()
    done = h.generated_tokens(eng)
    return {"wall_s": wall, "generated_tokens": done, "tok_per_s": done / wall,
            "finish": {r.key: (r.finish_reason, r.error_code, len(r.tokens)) for r in results},
            "all_finished_length": len(results) == rows and all(
                r.finish_reason == "length" and r.error_code is None and len(r.tokens) == new for r in results),
            "growth_events": [(g["from_pages"], g["to_pages"], round(g["seconds"], 3)) for g in s["growth_events"]],
            "peak_pages_in_use": s["peak_pages_in_use"], "peak_capacity_pages": s["peak_capacity_pages"],
            "peak_kv_bytes_in_use": s["peak_pages_in_use"] * lay.page_bytes, "pool_bytes_final": s["pool_bytes"],
            "tail_bytes": h.kv_pool(eng)["tail_bytes"],
            "rows_peak_kv_bytes": sum(r.stats.peak_kv_bytes for r in results), "mx_peak": int(mx.get_peak_memory()),
            "rss_peak_sampled": rss_peak, "maxrss_after": _maxrss(), "peak_concurrency": s["peak_concurrency"]}


PARTS = {"optimistic": optimistic, "modes": modes, "long": long_run}


def run(a) -> dict:
    parts = a.parts.split(",")
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"--parts: unknown {bad} (one of {', '.join(PARTS)})")
    return {p: PARTS[p](a) for p in parts}
