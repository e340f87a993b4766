"""GPU benchmark (MLX CUDA / Metal): kvbatch vs mlx-lm's BatchGenerator, side by side.

Random bf16 weights in real geometries (random weights cost the same compute).
Decode tokens/s at batch 1/8/64/256 (128-token prompts, 256 new tokens), kv
none/q8/q4 for kvbatch and none for mlx-lm; then 8k tokens of context. Also the
fraction of the memory-bandwidth roofline: bytes read per decode step (weights +
KV of every row, dense; `_mode`: at the mode's own KV bytes per token) / measured
copy bandwidth. At 8k context kvbatch runs before mlx-lm (mlx-lm ran out of memory
there); every case is written to --out as it finishes.

--repeats N runs each case's measured sequence (mlx-lm, then each kvbatch mode) N times,
reversing the order on every other round, and reports the median decode tok/s of each and
the ratio of medians (plus every run's number): a single pass is moved by what ran just
before it (session 4 saw 1.7x at 8B batch 256), and an alternating order spreads that
position effect over all sides instead of charging it to one.

--interleave K (long context only): the kvbatch modes' engines are alive at once and decode in
alternating blocks of K steps (benchmarks/interleave.py); each round's ratio to the first mode
and their median are reported. Use it to compare KV modes: whole runs one after another moved
by up to 1.5x on the shared H200.

    python benchmarks/gpu.py --geometry 1b --out results-1b.json [--repeats 3]
    python benchmarks/gpu.py --geometry 8b --batches '' --long-batches 8,16 --interleave 32 --long-new 448 \
        --skip-mlx-lm-long
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.configs

import kvbatch.engine  # noqa: F401  (BLAS first; harmless on GPU)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from kvbatch.engine.config import EngineOptions, KVConfig
from kvbatch.engine.engine import Engine
from kvbatch.engine.models.spec import model_spec
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.configs import engine_config  # noqa: E402
from interleave import Stepper, interleave, median_or_none, paired_ratios
from kv_quality import parse_mode  # 'q4+rot' -> KVConfig fields: the one parser of a mode's name

GEOMETRIES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
               tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, rope_theta=10000.0,
                 tie_word_embeddings=False),
}


class _NullTokenizer:
    eos_token_ids: list[int] = []

    def decode(self, tokens):
        return ""


def build(geometry: str):
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=131072,
                           **GEOMETRIES[geometry])
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    config = dict(GEOMETRIES[geometry], model_type="llama", max_position_embeddings=131072)
    return model, model_spec(f"llama-{geometry}-random", model, config)


def copy_bandwidth() -> float:
    a = mx.random.uniform(shape=(1 << 29,), dtype=mx.float32)  # 2 GiB
    mx.eval(a)
    for _ in range(2):
        mx.eval(a + 1)
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        mx.eval(a + 1)
    return 2 * a.nbytes * n / (time.perf_counter() - t)  # read + write


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    mx.random.seed(1)
    return mx.random.randint(0, vocab, (batch, length)).tolist()


def run_mlx_lm(model, ps, new_tokens):
    mx.reset_peak_memory()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=len(ps), prefill_batch_size=min(len(ps), 8))
    gen.insert(ps, [new_tokens] * len(ps))
    t0 = time.perf_counter()
    n = 0
    with gen.stats() as stats:
        while responses := gen.next_generated():
            n += len(responses)
    wall = time.perf_counter() - t0
    gen.close()
    return {"decode_tps": stats.generation_tps, "e2e_tps": n / wall, "tokens": n,
            "peak_gb": mx.get_peak_memory() / 1e9}


def mode_options(mode: str) -> tuple[str, EngineOptions]:
    """mode: a KV mode as kv_quality.parse_mode reads it (none, q8, q4, k8v4, q4+rot), optionally
    with engine options after '@', '+'-separated, dotted keys for the CUDA launch settings:
    "none@cuda.kernel_writes=false", "q8@cuda.warps=8+cuda.unroll=2" (an A/B of an engine option
    in the same process). -> (KV mode text, options). Values take the field's type (no omegaconf:
    the GPU machine has no network to install it)."""
    kv_mode, _, text = mode.partition("@")
    opts = EngineOptions()
    for item in filter(None, text.split("+")):
        key, _, value = item.partition("=")
        *path, name = key.split(".")
        obj = opts
        for part in path:
            obj = getattr(obj, part)
        old = getattr(obj, name)
        if isinstance(old, bool):
            value = value.lower() in ("1", "true", "yes")
        setattr(obj, name, type(old)(value))
    return kv_mode, opts


def _engine(model, spec, batch: int, mode: str, budget: int) -> Engine:
    kv_text, opts = mode_options(mode)
    kv = parse_mode(kv_text)
    return Engine(model, _NullTokenizer(), spec,
                  engine_config(kv_mode=kv.pop("mode"), group_size=kv.pop("group_size", 64), kv=kv, page_size=64,
                                max_batch=batch, prefill_chunk=2048, memory_budget=budget, allow_unvalidated=True,
                                options=opts))


def run_kvbatch(model, spec, ps, new_tokens, mode, budget):
    """One engine run of ps (mode as in mode_options)."""
    mx.reset_peak_memory()
    eng = _engine(model, spec, len(ps), mode, budget)
    t0 = time.perf_counter()
    res = eng.generate([Request(str(i), p, SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(ps)])
    wall = time.perf_counter() - t0
    s = eng.summary()
    bad = [r.error_code for r in res if r.error_code]
    return {"decode_tps": s["decode_tokens_per_s"], "e2e_tps": sum(len(r.tokens) for r in res) / wall,
            "tokens": sum(len(r.tokens) for r in res), "peak_gb": mx.get_peak_memory() / 1e9,
            "route": s["route"], "errors": bad, "kv_bytes_per_token": s["kv_bytes_per_token"],
            "lookahead": eng.lookahead, "wall_s": wall, "prefill_s": s["prefill_s"],
            "prefill_tps": s["prefill_tokens_per_s"], "prefill_passes": s.get("prefill_passes")}


def run_interleaved(model, spec, ps, new_tokens, modes: list[str], budget: int, block: int, warm: int) -> dict:
    """Every mode's engine alive at once, decoding in alternating blocks of `block` steps after
    `warm` untimed ones (benchmarks/interleave.py). Per mode: decode_tps = rows / median step
    time, and against the first mode (none): ratio_vs_first_runs (round by round) and their
    median, ratio_vs_first."""
    def maker(mode):
        def make():
            eng = _engine(model, spec, len(ps), mode, budget)
            return Stepper(eng, [Request(str(i), p, SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(ps)])
        return make

    mx.reset_peak_memory()
    runs = interleave({m: maker(m) for m in modes}, block, warm)
    out, first = {}, runs[modes[0]]["step_s"]
    for mode, r in runs.items():
        st = r["stepper"]
        res, s = st.results, st.eng.summary()
        med = median_or_none(r["step_s"])
        ratios = paired_ratios(r["step_s"], first)
        out[mode] = {"decode_tps": len(ps) / med if med else None, "step_ms_runs": [x and x * 1e3 for x in r["step_s"]],
                     "ratio_vs_first_runs": ratios, "ratio_vs_first": median_or_none(ratios), "block": block,
                     "warm_steps": warm, "tokens": sum(len(x.tokens) for x in res), "route": s["route"],
                     "errors": ([x.error_code for x in res if x.error_code]
                                + ([] if len(res) == len(ps) else ["missing"])),
                     "kv_bytes_per_token": s["kv_bytes_per_token"], "peak_gb": mx.get_peak_memory() / 1e9}
    return out


def warm_tokens(plen: int, new: int, page: int = 64) -> int:
    """New tokens a warm-up needs to seal a page in decode and, if the measured run reaches
    split-K (rows longer than the CUDA kernels' default split: CudaLaunch), to reach it too."""
    launch = EngineOptions().cuda
    need = (plen // page + 1) * page - plen + 2  # the first page filled by decode, sealed, then read
    split = max(launch.chunk, launch.unsplit)
    if plen + new > split:
        need = max(need, split + 2 - plen)
    return max(8, min(new, need))


def roofline(spec, kv_bpt, batch, context, bw):
    step_bytes = spec.weights_bytes + batch * context * kv_bpt
    return batch * bw / step_bytes


def guarded(fn, *args):
    """A case that raises (e.g. mlx-lm out of memory) is recorded, not fatal."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _median_run(rs: list[dict]) -> dict:
    """The run with the median decode tok/s (first run's fields if all failed), plus every
    run's decode tok/s in `decode_tps_runs`."""
    ok = [r for r in rs if r.get("decode_tps")]
    if not ok:
        return dict(rs[0])
    tps = [r["decode_tps"] for r in ok]
    med = statistics.median(tps)
    pick = dict(min(ok, key=lambda r: abs(r["decode_tps"] - med)))
    pick.update(decode_tps=med, decode_tps_runs=[r.get("decode_tps") for r in rs],
                peak_gb=max(r.get("peak_gb", 0) for r in ok))
    return pick


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="1b", choices=sorted(GEOMETRIES))
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--modes", default="none,q8,q4",
                    help="also MODE@OPTION=VALUE+OPTION2=V2, EngineOptions keys (mode_options)")
    ap.add_argument("--long-modes", default="", help="modes at long context (default: --modes)")
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--long-batches", default="1,8")
    ap.add_argument("--long-new", type=int, default=64)
    ap.add_argument("--budget-gb", type=float, default=120)
    ap.add_argument("--out", default="")
    ap.add_argument("--skip-mlx-lm-long", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="measured rounds per case, order reversed every other")
    ap.add_argument("--interleave", type=int, default=0,
                    help="long context: kvbatch modes decode side by side in blocks of this many steps "
                         "(benchmarks/interleave.py) instead of --repeats whole runs; 0 = off")
    a = ap.parse_args()
    model, spec = build(a.geometry)
    bw = copy_bandwidth()
    budget = int(a.budget_gb * 1e9)
    from kvbatch.engine.memory import kv_layout, layout_for
    kv_dense = kv_layout(spec, "none", 64, 64).bytes_per_token
    def kv_bpt(mode: str) -> int:
        return layout_for(spec, KVConfig(**{"page_size": 64, "group_size": 64,
                                            **parse_mode(mode.partition("@")[0])})).bytes_per_token
    out = {"geometry": a.geometry, "device": str(mx.default_device()), "mlx": mx.__version__,
           "python": platform.python_version(), "copy_bw_gbs": bw / 1e9, "weights_gb": spec.weights_bytes / 1e9,
           "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    cases = [(b, a.prompt, a.new) for b in map(int, filter(None, a.batches.split(",")))]  # '' = none
    cases += [(b, a.long, a.long_new) for b in map(int, filter(None, a.long_batches.split(","))) if a.long]
    for batch, plen, new in cases:
        ps = prompts(batch, plen, spec.vocab_size)
        ctx = plen + new // 2
        row = {"batch": batch, "prompt": plen, "new": new,
               "roofline_tps": roofline(spec, kv_dense, batch, ctx, bw)}
        long = plen >= a.long > 0
        # warm-up (kernel JIT for these shapes) for both sides, not measured: kvbatch runs past
        # its first page sealed in decode (q8/q4 kernels on packed pages) and past the first
        # split-K launch (rows longer than the default split), so no kernel variant compiles
        # inside the measured run. At long context kvbatch runs first (mlx-lm ran out of GPU
        # memory there before).
        warm = warm_tokens(plen, new)
        modes = (a.long_modes or a.modes).split(",") if long else a.modes.split(",")
        interleaved = long and a.interleave > 0  # (its engines warm up inside the run)
        for mode in ([] if interleaved else modes):
            guarded(run_kvbatch, model, spec, ps, warm, mode, budget)
        if not (long and a.skip_mlx_lm_long):
            guarded(run_mlx_lm, model, ps, warm)
        row["warmup_tokens"] = warm
        # the measured sequence: kvbatch first at long context (see above), mlx-lm first otherwise
        sides = [f"kvbatch_{m}" for m in modes]
        if not (long and a.skip_mlx_lm_long):
            sides = sides + ["mlx_lm_none"] if long else ["mlx_lm_none"] + sides
        if interleaved:  # kvbatch side by side (mlx-lm after it, as many rounds as --repeats)
            got = guarded(run_interleaved, model, spec, ps, new, modes, budget, a.interleave, warm)
            for m in modes:  # a failed run: its error in every mode's cell
                row[f"kvbatch_{m}"] = got.get(m, got)
            sides = [s for s in sides if s == "mlx_lm_none"]
        runs: dict[str, list] = {k: [] for k in sides}
        for rnd in range(max(a.repeats, 1)):
            for side in (sides if rnd % 2 == 0 else sides[::-1]):
                if side == "mlx_lm_none":
                    runs[side].append(guarded(run_mlx_lm, model, ps, new))
                else:
                    runs[side].append(guarded(run_kvbatch, model, spec, ps, new, side[len("kvbatch_"):], budget))
                mx.clear_cache()
        for side, rs in runs.items():
            row[side] = _median_run(rs)
        if "mlx_lm_none" not in row:
            row["mlx_lm_none"] = {"error": "skipped (--skip-mlx-lm-long)"}
        for mode in modes:
            row[f"kvbatch_{mode}"]["roofline_tps_mode"] = roofline(spec, kv_bpt(mode), batch, ctx, bw)
        base = row["mlx_lm_none"].get("decode_tps")
        base_runs = row["mlx_lm_none"].get("decode_tps_runs", [])
        for k, v in list(row.items()):
            if k.startswith("kvbatch_") and v.get("decode_tps"):
                v["ratio_vs_mlx_lm"] = v["decode_tps"] / base if base else None
                if len(base_runs) == len(v.get("decode_tps_runs", [])) > 1:  # round by round
                    v["ratio_runs"] = [x / y if x and y else None for x, y in zip(v["decode_tps_runs"], base_runs)]
                v["roofline_fraction"] = v["decode_tps"] / row["roofline_tps"]
                v["roofline_fraction_mode"] = v["decode_tps"] / v["roofline_tps_mode"]
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        if a.out:  # after every case: a crash later keeps what ran
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
        mx.clear_cache()


if __name__ == "__main__":
    main()
