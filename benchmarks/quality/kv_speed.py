"""KV quantization speed and size on SmolLM2-135M-Instruct (issue 5), all in one run.

1. KV bytes per token, read from the live buffers (kvbatch's page arrays after a real
   request, and freshly grown stores in float16 for the fp16 ratio), none vs q8 vs q4
   at group size 64.
2. For contexts of 2k and 6k tokens (the same license-text prompts for everyone):
   - kvbatch none / q8 / q4 (batch 1, and batch 4 at 2k): prefill tok/s from the
     engine's counters, best of --prefill-rounds rounds (batch 1; mode order reversed
     every other round); then the three engines' decode steps interleave round-robin
     (same machine conditions for all three, on a shared CPU), decode tok/s = rows /
     median decode-step time over `--new` tokens (EOS off);
   - mlx-lm's own path, `generate_step(kv_bits=8|4, kv_group_size=64,
     quantized_kv_start=0)` and without kv_bits, batch 1 on the same prompt:
     prefill = time to the first token, decode = 1 / median time between tokens (its
     three runs go one after another: generate_step evaluates asynchronously, so
     interleaving them would overlap their work).
     At 2k mlx-lm prefills in steps of 512 (as kvbatch's prefill_chunk), so its
     quantized prefill attends to its quantized cache; at 6k it prefills in one step
     (its quantized prefill there would take ~10 min per mode) and only its decode
     counts.
3. Where the time goes: one layer's decode attention at 2k/6k (SmolLM2 shapes, batch
   1 and 4) through kvbatch's own stores and functions: the dense route against the
   quantized route (on the streams the engine would use, and on one), and their parts
   alone (gathers, the quantized matmuls, float32 matmuls of the same shapes, the
   masked softmax against MLX's).

    python -m benchmarks quality.kv_speed --out /tmp/kv_speed.json
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from benchmarks import harness as h
from kvbatch.engine.config import EngineOptions
from kvbatch.engine.kv.routes import dense
from kvbatch.engine.kv.routes import quant as att
from kvbatch.engine.kv.routes.cpu_streams import cpu_streams, stream_split
from kvbatch.engine.kv.routes.softmax_cpu import masked_softmax
from kvbatch.engine.kv.store import DenseStore, QuantizedStore
from kvbatch.engine.memory import kv_layout
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--model", "tiny", "--contexts", "128", "--batch4-contexts", "128", "--new", "3", "--prefill-rounds", "2",
         "--micro-contexts", "128", "--reps", "2", "--ab-option", "q_in_place"]
TEXTS = ("GPL-3", "Apache-2.0", "GFDL-1.3", "LGPL-3", "MPL-2.0", "Artistic", "CC0-1.0", "GPL-2")
BITS = {"none": None, "q8": 8, "q4": 4}


def long_text_tokens(tok) -> list[int]:
    d = Path("/usr/share/common-licenses")
    text = "\n\n".join((d / n).read_text() for n in TEXTS if (d / n).exists())
    return tok.encode(text)


def kvbatch_modes(model, spec, prompts, new, group, page, rounds: int = 1, ab_option: str = "") -> dict:
    """none, q8 and q4 side by side. Prefill: `rounds` rounds, the mode order reversed every
    other round, best round per mode (other users' bursts only ever slow a run down).
    Decode: the last round's three engines step round-robin, one step of each in turn, so
    all three share the machine's conditions; decode tok/s = rows / median step time.
    ab_option: a boolean engine option (EngineOptions field); q8 and q4 then also run as "q8@0",
    "q4@0", built with it off (the others with it on), interleaved with the rest."""
    modes = ("none", "q8", "q4") + (("q8@0", "q4@0") if ab_option else ())
    best = {m: 0.0 for m in modes}
    runs = {}
    for rnd in range(rounds):
        for mode in (modes if rnd % 2 == 0 else modes[::-1]):
            opts = EngineOptions(**({ab_option: not mode.endswith("@0")} if ab_option else {}))
            eng = h.engine(model, h.NoEos(), spec, mode.split("@")[0], page_size=page, group_size=group,
                           max_batch=len(prompts), prefill_chunk=512, memory_budget=16 << 30, options=opts)
            for i, p in enumerate(prompts):
                eng.add(Request(f"r{i}", p, SamplingParams(max_tokens=new)))
            results = eng.step()  # admits: prefills every row, one decode step
            best[mode] = max(best[mode], eng.summary()["prefill_tokens_per_s"])
            if rnd < rounds - 1:
                eng.cancel()
                continue
            runs[mode] = {"eng": eng, "steps": [], "results": results}
    active = list(runs)
    while active:
        for mode in list(active):
            r = runs[mode]
            if not r["eng"].has_unfinished():
                active.remove(mode)
                continue
            t = time.perf_counter()
            r["results"] += r["eng"].step()
            r["steps"].append(time.perf_counter() - t)
    out = {}
    for mode, r in runs.items():
        res = r["results"]
        assert len(res) == len(prompts) and all(x.ok and x.stats.output_tokens == new for x in res), \
            [(x.error_code, x.error_message) for x in res]
        s = r["eng"].summary()
        out[mode] = {"prefill_tps": best[mode], "prefill_rounds": rounds,
                     "decode_tps": len(prompts) / statistics.median(r["steps"]),
                     "decode_tps_mean": s["decode_tokens_per_s"], "route": s["route"],
                     "kv_bytes_per_token": s["kv_bytes_per_token"], "pool_bytes": s["pool_bytes"],
                     "pool_tokens": s["pool_capacity_pages"] * page}
    return out


def mlx_lm_run(model, mode, prompt, new, group, prefill_step):
    bits = BITS[mode]
    kw = {"kv_bits": bits, "kv_group_size": group, "quantized_kv_start": 0} if bits else {}
    mx.clear_cache()
    t0 = time.perf_counter()
    stamps = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=new, prefill_step_size=prefill_step, **kw):
        mx.eval(tok)
        stamps.append(time.perf_counter())
    assert len(stamps) == new
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"prefill_tps": len(prompt) / (stamps[0] - t0), "decode_tps": 1 / statistics.median(steps),
            "decode_tps_mean": (new - 1) / (stamps[-1] - stamps[0]), "prefill_step_size": prefill_step}


def live_bytes_per_token(spec, page, group) -> dict:
    """Bytes per token of freshly grown stores in float32 and float16 (SmolLM2's KV geometry)."""
    out = {}
    for dtype_name, dtype in (("float32", mx.float32), ("float16", mx.float16)):
        row = {}
        for mode in ("none", "q8", "q4"):
            lay = kv_layout(spec, mode, page, group)
            if lay.quantized:
                st = QuantizedStore(spec.num_layers, spec.num_kv_heads, spec.head_dim, page, dtype, lay.key_bits,
                                    group, tail_slots=1)
            else:
                st = DenseStore(spec.num_layers, spec.num_kv_heads, spec.head_dim, page, dtype)
            st.grow(64)
            row[mode] = st.nbytes / (st.capacity_pages * page)
            del st
        row["q8_ratio"], row["q4_ratio"] = row["q8"] / row["none"], row["q4"] / row["none"]
        out[dtype_name] = row
    return out


def attention_micro(spec, group, page, contexts=(2048, 6144), reps: int = 30) -> list[dict]:
    """One layer's decode attention (ms), SmolLM2 shapes, through kvbatch's own stores and
    functions (keys per channel when page % group == 0, as the engine does on the CPU), and
    its parts, each evaluated alone: gathers, the two quantized matmuls, the masked softmax;
    against the dense route (gather + attention) and float32 matmuls of the same shapes."""
    H, Hq, D, P = spec.num_kv_heads, spec.num_heads, spec.head_dim, page
    rep, scale = Hq // H, D ** -0.5
    k_axis = "channel" if P % group == 0 else "token"
    streams = cpu_streams(min(os.cpu_count() or 1, 4))  # the CPU route's default
    rows = []

    def _bench(f):
        return h.median_ms(f, n=reps, warm=2)

    for T in contexts:
        for B in (1, 4):
            n = T // P
            table = mx.arange(n * B, dtype=mx.int32).reshape(B, n)
            tails = mx.arange(B, dtype=mx.int32)
            q = mx.random.normal((B, Hq, 1, D))
            mask_all = mx.ones((B, 1, 1, T + P), mx.bool_)
            ds = DenseStore(1, H, D, P, mx.float32)
            ds.grow(n * B)
            ds.k[0], ds.v[0] = mx.random.normal(ds.k[0].shape), mx.random.normal(ds.v[0].shape)
            mx.eval(ds.k, ds.v)
            r = {"context": T, "batch": B, "k_axis": k_axis,
                 "dense_gather_attention_ms": _bench(lambda: dense.dense_attention(
                     q, *ds.gather(0, table), mask_all[..., :T], scale, False, grouped=True)),
                 "dense_gather_ms": _bench(lambda: ds.gather(0, table))}
            kf, vf = ds.gather(0, table)
            qf = q.reshape(B, H, rep, D)
            probs = mx.softmax(mx.random.normal((B, H, rep, T)), axis=-1)
            mx.eval(kf, vf, probs)
            r["f32_matmul_scores_ms"] = _bench(lambda: qf @ kf.swapaxes(-1, -2))
            r["f32_matmul_values_ms"] = _bench(lambda: probs @ vf)
            sc = mx.random.normal((B, H, rep, T + P))
            r["masked_softmax_ms"] = _bench(lambda: masked_softmax(sc, mask_all))
            r["mlx_softmax_ms"] = _bench(lambda: mx.softmax(mx.where(mask_all, sc, -mx.inf), axis=-1, precise=True))
            for bits in (8, 4):
                st = QuantizedStore(1, H, D, P, mx.float32, bits, group, tail_slots=B, k_axis=k_axis)
                st.grow(n * B)
                st.store_pages(0, mx.arange(n * B * P, dtype=mx.int32), kf.transpose(0, 2, 1, 3).reshape(-1, H, D),
                                vf.transpose(0, 2, 1, 3).reshape(-1, H, D))
                mx.eval(st.q[0])

                def quant(k):
                    tk, tv = st.gather_tails(0, tails)
                    cuts = [n * i // k for i in range(k + 1)]
                    qk = []
                    for i, (a, z) in enumerate(zip(cuts, cuts[1:])):
                        with mx.stream(streams[i] or mx.default_stream(mx.default_device())):
                            qk.append(st.gather_quantized(0, table[:, a:z], "k"))
                    return att.quantized_decode_attention(q, qk, st.gather_quantized(0, table, "v"), tk, tv, None,
                                                          None, scale, group, bits, streams,
                                                          k_transposed=k_axis == "channel", mask=mask_all)

                split = stream_split(B * H, T, D, min(len(streams), n))
                r[f"q{bits}_attention_ms"] = _bench(lambda: quant(split))
                r[f"q{bits}_streams"] = split
                r[f"q{bits}_attention_1stream_ms"] = _bench(lambda: quant(1))
                r[f"q{bits}_gather_k_ms"] = _bench(lambda: st.gather_quantized(0, table, "k"))
                r[f"q{bits}_gather_v_ms"] = _bench(lambda: st.gather_quantized(0, table, "v"))
                kq, vq = st.gather_quantized(0, table, "k"), st.gather_quantized(0, table, "v")
                mx.eval(kq, vq)
                r[f"q{bits}_qmm_scores_ms"] = _bench(lambda: mx.quantized_matmul(
                    qf, *kq, transpose=k_axis != "channel", group_size=group, bits=bits))
                r[f"q{bits}_qmm_values_ms"] = _bench(lambda: mx.quantized_matmul(
                    probs, *vq, transpose=False, group_size=group, bits=bits))
            rows.append(r)
            print("  attention micro " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in r.items()), flush=True)
    return rows


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2", help=", ".join(h.MODEL_NAMES))
    ap.add_argument("--contexts", default="2048,6144")
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--batch4-contexts", default="2048", help="contexts also run at batch 4 (kvbatch)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--micro-contexts", default="2048,6144", help="attention micro: contexts")
    ap.add_argument("--reps", type=int, default=30, help="attention micro: timed evaluations per measure")
    ap.add_argument("--prefill-rounds", type=int, default=2, help="kvbatch batch-1 prefill rounds (best kept)")
    ap.add_argument("--ab-option", default="", help="also run q8/q4 with this boolean engine option off "
                    "(e.g. q_in_place), interleaved; labels q8@0, q4@0")


def run(args) -> dict:
    t_start = time.perf_counter()
    model, tok, spec = h.load(args.model)
    text = long_text_tokens(tok)
    report = {"model": spec.name, "dtype": spec.dtype, "new_tokens": args.new, "group_size": args.group_size,
              "ab_option": args.ab_option,
              "page_size": args.page_size, "qmm_streams": len(cpu_streams(min(os.cpu_count() or 1, 4))), "runs": []}

    report["bytes_per_token_fresh_stores"] = live_bytes_per_token(spec, args.page_size, args.group_size)
    print("KV bytes/token (fresh stores):", json.dumps(report["bytes_per_token_fresh_stores"]), flush=True)
    if not args.skip_micro:
        report["attention_micro"] = attention_micro(spec, args.group_size, args.page_size,
                                                    tuple(map(int, args.micro_contexts.split(","))), args.reps)

    b4 = {int(c) for c in args.batch4_contexts.split(",") if c}
    for ctx in (int(c) for c in args.contexts.split(",")):
        assert len(text) >= ctx + 3 * 97, "not enough text for the prompts"
        for batch in ([1, 4] if ctx in b4 else [1]):
            prompts = [text[i * 97: i * 97 + ctx] for i in range(batch)]
            base = None
            side = kvbatch_modes(model, spec, prompts, args.new, args.group_size, args.page_size,
                                 args.prefill_rounds if batch == 1 else 1, args.ab_option)
            for mode in [m for m in ("none", "q8", "q4", "q8@0", "q4@0") if m in side]:  # none first: the base
                r = side[mode]
                r.update(impl="kvbatch", mode=mode.split("@")[0], label=mode, context=ctx, batch=batch)
                if "@" in mode:
                    r["options"] = {args.ab_option: False}
                elif args.ab_option:
                    r["options"] = {args.ab_option: True}
                r["live_bytes_per_token"] = r["pool_bytes"] / r["pool_tokens"]
                base = base or r
                for k in ("prefill_tps", "decode_tps", "live_bytes_per_token"):
                    r[k.replace("_tps", "") + "_vs_none"] = r[k] / base[k]
                report["runs"].append(r)
                print(f"kvbatch ctx={ctx} batch={batch} {mode}: prefill {r['prefill_tps']:.1f} tok/s "
                      f"({r['prefill_vs_none']:.2f}x), decode {r['decode_tps']:.2f} tok/s "
                      f"({r['decode_vs_none']:.2f}x), live KV {r['live_bytes_per_token']:.0f} B/token "
                      f"({r['live_bytes_per_token_vs_none']:.3f}x)", flush=True)
            if args.skip_mlx_lm or batch != 1:
                continue
            base = None
            step = 512 if ctx <= 2048 else 1 << 14
            for mode in ("none", "q8", "q4"):
                r = mlx_lm_run(model, mode, prompts[0], args.new, args.group_size, step)
                r.update(impl="mlx-lm", mode=mode, context=ctx, batch=1)
                base = base or r
                r["prefill_vs_none"] = r["prefill_tps"] / base["prefill_tps"]
                r["decode_vs_none"] = r["decode_tps"] / base["decode_tps"]
                report["runs"].append(r)
                print(f"mlx-lm  ctx={ctx} batch=1 {mode}: prefill {r['prefill_tps']:.1f} tok/s "
                      f"({r['prefill_vs_none']:.2f}x, step {step}), decode {r['decode_tps']:.2f} tok/s "
                      f"({r['decode_vs_none']:.2f}x)", flush=True)

    report["seconds"] = time.perf_counter() - t_start
    print(f"total {report['seconds']:.0f}s", flush=True)
    return report
