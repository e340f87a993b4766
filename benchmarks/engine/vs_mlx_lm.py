"""kvbatch Engine vs mlx-lm's BatchGenerator: same model, prompts and machine, one run (issue 3).

For each model (SmolLM2-135M float32, and a 4M-parameter random llama) and batch
size (1, 8, 32), both generate exactly `new` tokens for the same random 128-token
prompts (EOS ignored on both sides, greedy). Reported:

- decode tok/s: generated tokens / (wall time of the whole run - prefill time),
  so per-step Python overhead counts on both sides; each library's own counter
  is kept too (`own_decode_tps`).
- peak memory: mx.get_peak_memory() of the run (reset before), and its ratio.
- KV bytes held vs needed: needed = tokens actually stored (prompt + new - 1 per
  row) x bytes per token. kvbatch: pages held by rows at peak (and the pool's
  allocated capacity); mlx-lm: BatchKVCache allocated bytes at their peak.
  Target: held <= needed + one page per row per layer.

    flock /tmp/kvbatch-bench.lock .venv/bin/python benchmarks/engine_vs_mlx_lm.py --out /tmp/evm.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.configs

import kvbatch.engine as engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.mlx_lm_bridge import as_shipped
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.types import Request, SamplingParams
from tests.configs import engine_config

# The FACTS "4M-parameter" random llama: 4 layers, hidden 256, 4 heads / 2 KV heads of 64.
TINY = dict(source="tiny", name="tiny-4m", family="llama", num_layers=4, hidden_size=256, num_heads=4,
            num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=4096, context_length=4096)


class _NoEos:
    """The model's tokenizer with EOS switched off, so both sides generate exactly `new` tokens."""

    eos_token_ids: list[int] = []

    def __init__(self, tok):
        self._tok = tok

    def decode(self, tokens):
        return ""


def prompts_for(batch: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    key = mx.random.key(seed)
    return mx.random.randint(3, min(vocab, 32000), (batch, length), key=key).tolist()


def run_mlx_lm(model, ps, new):
    as_shipped(model)  # mlx-lm runs the model as it ships (kvbatch's Engine wraps its RoPE and MLPs on the CPU)
    mx.clear_cache()
    mx.reset_peak_memory()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(ps), prefill_batch_size=len(ps))
    t0 = time.perf_counter()
    uids = gen.insert(ps, [new] * len(ps))
    out = {u: [] for u in uids}
    kv_peak = 0
    with gen.stats() as stats:
        while responses := gen.next_generated():
            kv_peak = max(kv_peak, sum(c.keys.nbytes + c.values.nbytes
                                       for c in gen._generation_batch.prompt_cache if c.keys is not None))
            for r in responses:
                out[r.uid].append(r.token)
    wall = time.perf_counter() - t0
    gen.close()
    n = sum(len(v) for v in out.values())
    return {"tokens": n, "wall_s": wall, "prefill_s": stats.prompt_time,
            "decode_tps": n / (wall - stats.prompt_time), "own_decode_tps": stats.generation_tps,
            "peak_mem": int(mx.get_peak_memory()), "kv_held": kv_peak,
            "outputs": [out[u] for u in uids]}


def run_kvbatch(model, tok, spec, ps, new, page_size, options: EngineOptions | None = None):
    mx.clear_cache()
    mx.reset_peak_memory()
    eng = Engine(model, _NoEos(tok), spec, engine_config(page_size=page_size, max_batch=len(ps), prefill_chunk=512,
                                                         options=options))
    t0 = time.perf_counter()
    res = eng.generate([Request(str(i), p, SamplingParams(max_tokens=new)) for i, p in enumerate(ps)])
    wall = time.perf_counter() - t0
    s = eng.summary()
    bad = [r.error_code for r in res if r.error_code]
    if bad:
        raise RuntimeError(f"kvbatch rows failed: {bad}")
    n = sum(len(r.tokens) for r in res)
    return {"tokens": n, "wall_s": wall, "prefill_s": s["prefill_s"],
            "decode_tps": n / (wall - s["prefill_s"]), "own_decode_tps": s["decode_tokens_per_s"],
            "peak_mem": int(mx.get_peak_memory()),
            "kv_held": s["peak_pages_in_use"] * eng.layout.page_bytes,
            "kv_rows_peak_sum": sum(r.stats.peak_kv_bytes for r in res),
            "kv_pool": s["pool_bytes"], "growth_events": len(s["growth_events"]),
            "page_bytes": eng.layout.page_bytes, "bytes_per_token": s["kv_bytes_per_token"],
            "outputs": [r.tokens for r in res]}


def compare(name, model, tok, spec, batch, plen, new, page_size, repeats=1):
    """Both sides on the same prompts, interleaved `repeats` times; the faster run of each is kept
    (the machine is shared: the best run is the least disturbed one)."""
    ps = prompts_for(batch, plen, spec.vocab_size)
    runs_a, runs_b = [], []
    for _ in range(repeats):
        runs_a.append(run_mlx_lm(model, ps, new))
        runs_b.append(run_kvbatch(model, tok, spec, ps, new, page_size))
    a = max(runs_a, key=lambda r: r["decode_tps"])
    b = max(runs_b, key=lambda r: r["decode_tps"])
    a["all_decode_tps"] = [round(r["decode_tps"], 1) for r in runs_a]
    b["all_decode_tps"] = [round(r["decode_tps"], 1) for r in runs_b]
    needed = batch * (plen + new - 1) * b["bytes_per_token"]
    allowed = needed + batch * b["page_bytes"]
    same = sum(x == y for x, y in zip(a.pop("outputs"), b.pop("outputs")))
    row = {"model": name, "batch": batch, "prompt": plen, "new": new, "page_size": page_size,
           "decode_ratio": b["decode_tps"] / a["decode_tps"], "peak_mem_ratio": b["peak_mem"] / a["peak_mem"],
           "kv_needed": needed, "kv_allowed": allowed, "kv_target_met": b["kv_held"] <= allowed,
           "rows_same_tokens": f"{same}/{batch}", "mlx_lm": a, "kvbatch": b}
    print(json.dumps(row), flush=True)
    return row


def step_breakdown(model, tok, spec, batch, plen, page_size, steps=24):
    """Where kvbatch's decode step goes: ms per step as is (CPU: pages read in place) and with the
    pages gathered into contiguous K/V first (`engine.options.in_place=false`, the path before
    in-place decode)."""
    out = {}
    for name, opts in (("step_ms", EngineOptions()), ("step_ms_gathered", EngineOptions(in_place=False))):
        eng = Engine(model, _NoEos(tok), spec, engine_config(page_size=page_size, max_batch=batch, prefill_chunk=512,
                                                             options=opts))
        for i, p in enumerate(prompts_for(batch, plen, spec.vocab_size)):
            eng.add(Request(str(i), p, SamplingParams(max_tokens=10 ** 6)))
        for _ in range(5):  # admission + prefill + first step, then warm steps
            eng.step()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        out[name] = (time.perf_counter() - t) / steps * 1e3
        out["in_place" if name == "step_ms" else "in_place_gathered"] = eng.cache.attention.in_place
        out["context_at_end"] = eng.scheduler.running[0].kv.length
        eng.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--new-smollm2-32", type=int, default=128, help="new tokens for SmolLM2 at batch 32")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--page-sizes", default="", help="extra kvbatch page sizes to try (e.g. 64,256)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per side; the best is kept")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--cache-limit-gib", type=float, default=2.0,
                    help="MLX buffer-cache limit for both sides (MLX CPU's default is 32 MiB; kvbatch's "
                         "Engine raises it to its priced step workspace, so set it once for both)")
    ap.add_argument("--out", default="")
    ap.add_argument("--profile-batches", default="8,32", help="batches for the decode-step breakdown ('' = none)")
    a = ap.parse_args()
    cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="kvbatch-bench-")
    default_cache_limit = mx.set_cache_limit(int(a.cache_limit_gib * (1 << 30)))
    import mlx_lm
    out = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version(),
           "device": str(mx.default_device()), "blas": engine.blas_in_use(), "argv": sys.argv[1:],
           "mlx_cache_limit": int(a.cache_limit_gib * (1 << 30)), "mlx_default_cache_limit": default_cache_limit,
           "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    for name in a.models.split(","):
        cfg = ModelConfig(**TINY, cache_dir=cache_dir) if name == "tiny" else \
            ModelConfig(source="smollm2", cache_dir=cache_dir)
        model, tok, spec = load_model(cfg)
        compare(name, model, tok, spec, 2, 16, 8, a.page_size)  # warm-up, not recorded
        for batch in map(int, a.batches.split(",")):
            new = a.new_smollm2_32 if (name == "smollm2" and batch >= 32) else a.new
            for page_size in [a.page_size] + [int(x) for x in a.page_sizes.split(",") if x]:
                out["rows"].append(compare(name, model, tok, spec, batch, a.prompt, new, page_size, a.repeats))
        for batch in [int(x) for x in a.profile_batches.split(",") if x]:
            prof = {"model": name, "batch": batch, "page_size": a.page_size,
                    **step_breakdown(model, tok, spec, batch, a.prompt, a.page_size)}
            print(json.dumps(prof), flush=True)
            out.setdefault("profile", []).append(prof)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
