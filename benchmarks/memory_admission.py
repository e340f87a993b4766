"""Memory and admission (issue 6).

(a) `admission`: with a fixed KV budget (default 1 GiB), how many concurrent rows of
    4,096 tokens (prompt + max_tokens) each KV mode admits for SmolLM2-135M geometry.
    Two numbers per mode: the arithmetic (1 GiB // one row's worst-case KV pages), and
    the real Engine's admission with budget = weights + workspace + growth copy + 1 GiB
    (64 rows submitted, one admission round; rows admitted = rows running).
(b) `long`: SmolLM2, R rows x N new tokens (EOS ignored, greedy) with kv=q8 under a
    budget equal to the plan for those R rows at once, so the pool starts empty and
    grows several times. Progress goes to --log every --every seconds. Reported: all
    rows finished, growth events, peak RSS (getrusage ru_maxrss, and psutil sampled),
    MLX peak (mx.get_peak_memory), budget, weights, and the plan's predictions.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/memory_admission.py admission --out /tmp/ma_a.json
    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/memory_admission.py long \
        --rows 8 --new 8000 --log /tmp/ma_long.log --out /tmp/ma_long.json
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.configs

import kvbatch.engine as engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import psutil

from kvbatch.engine.engine import Engine
from kvbatch.engine.memory import MemoryModel, format_plan, kv_layout
from kvbatch.engine.sizes import fmt_bytes, parse_size
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.configs import engine_config

GiB = 1 << 30


class _NoEos:
    """The model's tokenizer with EOS switched off, so every row generates exactly max_tokens."""

    eos_token_ids: list[int] = []

    def __init__(self, tok):
        self._tok = tok

    def decode(self, tokens):
        return self._tok.decode(tokens)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def admission(model, tok, spec, kv_budget: int, row_tokens: int, page_size: int, group_size: int) -> list[dict]:
    rows = []
    prompt = tok.encode("Write a very long essay about the history of the printing press.")
    max_tokens = row_tokens - len(prompt)
    for mode in ("none", "q8", "q4"):
        lay = kv_layout(spec, mode, page_size, group_size)
        row_kv = lay.pages_for(row_tokens) * lay.page_bytes
        arithmetic = kv_budget // row_kv
        probe = MemoryModel(spec, lay, 0, 512, 64)
        # budget = weights + workspace (for `arithmetic` rows) + growth copy + the fixed KV budget
        budget = (spec.weights_bytes + kv_budget + probe.growth_transient(kv_budget)
                  + probe.workspace(max(arithmetic, 1), row_tokens, len(prompt)))
        eng = Engine(model, _NoEos(tok), spec, engine_config(kv_mode=mode, page_size=page_size,
                                                             group_size=group_size, max_batch=64,
                                                             memory_budget=budget))
        for i in range(64):
            eng.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
        eng.step()  # one admission round (every row that fits starts and is prefilled), one decode step
        admitted = len(eng.scheduler.running)
        eng.cancel()
        # the same fixed 1 GiB with the workspace taken out of it (total = weights + 1 GiB)
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


def long_run(model, tok, spec, rows: int, new: int, page_size: int, group_size: int, log: str,
             every: float, budget_scale: float) -> dict:
    texts = ["Tell me a long story about a lighthouse keeper.", "Explain how a steam engine works, in detail.",
             "Write a travel diary of a journey across Siberia.", "Describe the life cycle of a star.",
             "Write a long letter from a sailor to his sister.", "Explain the rules of chess to a child.",
             "Write the history of a small mountain village.", "Describe a day in a medieval monastery."]
    prompts = [tok.encode(texts[i % len(texts)]) for i in range(rows)]
    worst = [min(len(p) + new, spec.context_length) for p in prompts]
    lay = kv_layout(spec, "q8", page_size, group_size)
    probe = MemoryModel(spec, lay, 0, 512, rows)
    max_prompt = max(len(p) for p in prompts)
    budget = int(probe.bytes_for(worst, max_prompt) * budget_scale)
    eng = Engine(model, _NoEos(tok), spec, engine_config(kv_mode="q8", page_size=page_size, group_size=group_size,
                                                         max_batch=rows, memory_budget=budget))
    plan = eng.plan(max(worst), max_prompt)
    predicted_total = eng.memory.bytes_for(worst, max_prompt)
    predicted_kv = sum(lay.pages_for(w) for w in worst) * lay.page_bytes
    out = {"rows": rows, "new": new, "prompt_tokens": [len(p) for p in prompts], "page_size": page_size,
           "group_size": group_size, "budget": budget, "weights": spec.weights_bytes, "plan": plan,
           "plan_line": format_plan(plan), "predicted_total": predicted_total, "predicted_kv": predicted_kv,
           "rss_before": _rss(), "maxrss_before": _maxrss()}
    print(out["plan_line"], flush=True)
    logf = open(log, "a") if log else sys.stdout

    def say(msg):
        logf.write(msg + "\n")
        logf.flush()

    peak = {"rss": _rss()}
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], _rss())
            time.sleep(0.2)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    mx.clear_cache()
    mx.reset_peak_memory()
    say(f"start {time.strftime('%H:%M:%S')} {out['plan_line']} budget={budget} predicted_total={predicted_total}")
    for i, p in enumerate(prompts):
        eng.add(Request(f"row{i}", p, SamplingParams(max_tokens=new)))
    t0 = last = time.perf_counter()
    last_tok = 0
    results = []
    while eng.has_unfinished():  # step by step, so progress can be logged between steps
        results += eng.step()
        now = time.perf_counter()
        if now - last >= every:
            c = eng.cache
            rate = (eng.output.generated_tokens - last_tok) / (now - last)
            say(f"{now - t0:8.0f}s tokens={eng.output.generated_tokens} ({rate:.1f} tok/s now) "
                f"running={len(eng.scheduler.running)} "
                f"pool={c.capacity_pages}p/{fmt_bytes(c.capacity_bytes)} in_use={c.pool.in_use}p "
                f"growths={len(c.growth_events)} rss={fmt_bytes(_rss())} mx_active={fmt_bytes(mx.get_active_memory())} "
                f"mx_peak={fmt_bytes(mx.get_peak_memory())}")
            last, last_tok = now, eng.output.generated_tokens
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    s = eng.summary()
    mx_peak = int(mx.get_peak_memory())
    out.update({
        "wall_s": wall, "generated_tokens": eng.output.generated_tokens,
        "tok_per_s": eng.output.generated_tokens / wall,
        "finish": {r.key: (r.finish_reason, r.error_code, len(r.tokens)) for r in results},
        "all_finished_length": all(r.finish_reason == "length" and r.error_code is None and len(r.tokens) == new
                                   for r in results) and len(results) == rows,
        "growth_events": [(g["from_pages"], g["to_pages"], round(g["seconds"], 3)) for g in s["growth_events"]],
        "peak_pages_in_use": s["peak_pages_in_use"], "peak_capacity_pages": s["peak_capacity_pages"],
        "peak_kv_bytes_in_use": s["peak_pages_in_use"] * lay.page_bytes,
        "pool_bytes_final": s["pool_bytes"], "tail_bytes": eng.cache.store.tail_nbytes,
        "rows_peak_kv_bytes": sum(r.stats.peak_kv_bytes for r in results),
        "mx_peak": mx_peak, "rss_peak_sampled": peak["rss"], "maxrss_after": _maxrss(),
        "peak_concurrency": s["peak_concurrency"],
    })
    out["checks"] = {
        "mx_peak <= budget": mx_peak <= budget,
        "rss_peak_sampled <= budget + weights": peak["rss"] <= budget + spec.weights_bytes,
        "maxrss <= budget + weights": out["maxrss_after"] <= budget + spec.weights_bytes,
        "predicted_kv / peak_kv_in_use": predicted_kv / max(out["peak_kv_bytes_in_use"], 1),
        "predicted_total / mx_peak": predicted_total / mx_peak,
    }
    say(f"done {wall:.0f}s " + json.dumps(out["checks"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["admission", "long"])
    ap.add_argument("--kv-budget", default="1GiB")
    ap.add_argument("--row-tokens", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=8000)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--budget-scale", type=float, default=1.0, help="long: budget = plan for the rows x this")
    ap.add_argument("--every", type=float, default=30.0)
    ap.add_argument("--log", default="")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import mlx_lm
    model, tok, spec = load_model(ModelConfig(source="smollm2", cache_dir=a.cache_dir))
    res = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
           "device": str(mx.default_device()), "blas": engine.blas_in_use(), "argv": sys.argv[1:],
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": spec.name, "weights_bytes": spec.weights_bytes}
    if a.what == "admission":
        res["rows"] = admission(model, tok, spec, parse_size(a.kv_budget), a.row_tokens, a.page_size, a.group_size)
    else:
        res["long"] = long_run(model, tok, spec, a.rows, a.new, a.page_size, a.group_size, a.log, a.every,
                               a.budget_scale)
    print(json.dumps(res, indent=1, default=str), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
