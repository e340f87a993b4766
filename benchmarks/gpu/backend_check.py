"""Correctness of the paged engine on whatever MLX backend runs here (CPU, CUDA, Metal).

Teacher-forced logits of a batch through kvbatch vs mlx-lm single-stream references
(KVCache for kv=none, tests.engine.kv_reference.QuantRefCache for q8/q4), for float32,
bfloat16 and float16 random llama/qwen3 models. Prints one line per case and exits
non-zero on a mismatch. Used on the lent GPU, where the pytest suite's fixtures
(SmolLM2 wheel, Hydra) are not installed. On CUDA also (--parts kernels,bench) the fused decode kernels
against a float64 reference, and their speed under launch-setting variants.

    python -m benchmarks gpu.backend_check --parts kernels,engine
"""
from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import KVCache

from benchmarks import harness as h
from kvbatch.engine.config import KV_BITS, CudaLaunch, EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.models.spec import model_spec
from kvbatch.engine.testing import engine_config
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from tests.engine.kv_reference import StoredPagesRefCache, record_page_tables, teacher_forced_logits

SMOKE = ["--parts", "kernels,bench,engine", "--engine-families", "llama:64", "--engine-modes", "q8",
         "--engine-pages", "16", "--no-engine-half", "--engine-rows", "2", "--engine-tokens", "6",
         "--kernel-modes", "none", "--kernel-dtypes", "float32", "--kernel-chunks", "default",
         "--bench-batches", "1", "--bench-dims", "64", "--bench-contexts", "128"]


class _Tok:
    eos_token_ids: list[int] = []

    def decode(self, t):
        return ""


def build(family: str, head_dim: int, dtype):
    cfg = dict(model_type=family, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=512,
               rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)
    mod = llama if family == "llama" else qwen3
    mx.random.seed(0)
    m = mod.Model(mod.ModelArgs(**cfg))
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m, model_spec(f"{family}-{head_dim}", m, cfg)


def check(family, head_dim, dtype, mode, page, tol, options: EngineOptions | None = None, rows: int = 8,
          tokens: int = 40) -> bool:
    m, spec = build(family, head_dim, dtype)
    bits = {"q8": 8, "q4": 4, "k8v4": 8}.get(mode)
    chunk = 24
    eng = Engine(m, _Tok(), spec, engine_config(kv_mode=mode, page_size=page, max_batch=8, prefill_chunk=chunk,
                                                memory_budget=2 << 30, allow_unvalidated=True, options=options))
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(rows)]
    cont = [[(3 * i + 5 * j) % 500 + 1 for j in range(tokens)] for i in range(rows)]
    tables = record_page_tables(h.kv_store(eng))
    for i, c in enumerate(cont):
        eng.hooks.force(str(i), c)
    res = eng.generate([Request(str(i), p, SamplingParams(max_tokens=tokens)) for i, p in enumerate(prompts)])
    worst = 0.0
    for p, c, r in zip(prompts, cont, res):
        if r.error_code:
            print(f"FAIL {family} hd={head_dim} {dtype} {mode} page={page}: {r.error_code} {r.error_message}")
            return False
        mk = (lambda: [KVCache() for _ in m.layers]) if not bits else \
            (lambda: [StoredPagesRefCache(h.kv_store(eng).store, i, tables[r.key]) for i in range(len(m.layers))])
        ref = teacher_forced_logits(m, p, c, mk, chunk)
        worst = max(worst, max(float(mx.abs(a - b).max()) for a, b in zip(eng.hooks.logits[r.key], ref)))
    ok = worst <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {family} hd={head_dim} {str(dtype):14s} kv={mode:4s} page={page:3d} "
          f"max|dlogit|={worst:.2e} route={eng.summary()['route']} growths={len(eng.summary()['growth_events'])}",
          flush=True)
    return ok


def _rand_rows(P: int, rng, n_pages: int, lengths: list[int]) -> list[list[int]]:
    perm = rng.permutation(n_pages).tolist()
    tables, at = [], 0
    for n in lengths:
        k = -(-n // P)
        tables.append(perm[at:at + k])
        at += k
    return tables


def kernel_case(mode: str, dtype, D: int, rep: int, P: int, chunk, hkv: int = 2, group: int = 64,
                lengths=(1, 17, 100, 200, 513), launch: dict | None = None) -> float:
    """Fused kernel vs a float64 numpy reference on the same pages (dense, or packed + tail).
    chunk: tokens per split (None: the default); launch: other CudaLaunch settings."""
    import numpy as np

    from kvbatch.engine.kv.routes import cuda_kernels as ca

    settings = dict(launch or {}, **({} if chunk is None else {"chunk": chunk, "unsplit": chunk}))
    tune = CudaLaunch(**settings)

    rng = np.random.default_rng(D + rep + P)
    B, n_pages = len(lengths), sum(-(-n // P) for n in lengths) + 3
    q = mx.array(rng.standard_normal((B, hkv * rep, 1, D)).astype(np.float32)).astype(dtype)
    kp = mx.array(rng.standard_normal((n_pages, hkv, P, D)).astype(np.float32)).astype(dtype)
    vp = mx.array(rng.standard_normal((n_pages, hkv, P, D)).astype(np.float32)).astype(dtype)
    tables = _rand_rows(P, rng, n_pages, list(lengths))
    scale = D ** -0.5
    K, V = np.array(kp.astype(mx.float32)), np.array(vp.astype(mx.float32))
    if mode == "none":
        width = max(len(t) for t in tables)
        table = mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32)
        out = ca.paged_decode_attention(q, kp, vp, table, mx.array(list(lengths), dtype=mx.int32), scale, tune)
        rows_k = [K[t].transpose(1, 0, 2, 3).reshape(hkv, -1, D)[:, :n] for t, n in zip(tables, lengths)]
        rows_v = [V[t].transpose(1, 0, 2, 3).reshape(hkv, -1, D)[:, :n] for t, n in zip(tables, lengths)]
    else:
        kb, vb = KV_BITS[mode]
        packed = list(mx.quantize(kp, group_size=group, bits=kb)) + list(mx.quantize(vp, group_size=group, bits=vb))
        Kd = np.array(mx.dequantize(*packed[:3], group_size=group, bits=kb, stream=mx.cpu).astype(mx.float32))
        Vd = np.array(mx.dequantize(*packed[3:], group_size=group, bits=vb, stream=mx.cpu).astype(mx.float32))
        n_main = [((n - 1) // P) * P for n in lengths]  # sealed pages; the rest (1..P tokens) in the tail
        tk = mx.array(rng.standard_normal((B + 2, hkv, P, D)).astype(np.float32)).astype(dtype)
        tv = mx.array(rng.standard_normal((B + 2, hkv, P, D)).astype(np.float32)).astype(dtype)
        tails = [int(x) for x in rng.permutation(B + 2)[:B]]
        sealed = [t[:m // P] for t, m in zip(tables, n_main)]
        width = max(1, max(len(t) for t in sealed))
        table = mx.array([t + [t[0] if t else 0] * (width - len(t)) for t in sealed], dtype=mx.int32)
        pos = mx.array([n - 1 for n in lengths], dtype=mx.int32)  # the new token's position: n - 1 keys before it
        out = ca.paged_decode_attention_quantized(q, ca.QuantPages(packed, tk, tv, kb, group, vb),
                                                  mx.array(tails, dtype=mx.int32), table, pos, scale, tune)
        TK, TV = np.array(tk.astype(mx.float32)), np.array(tv.astype(mx.float32))
        rows_k, rows_v = [], []
        for t, m, n, tl in zip(sealed, n_main, lengths, tails):
            rows_k.append(np.concatenate([Kd[t].transpose(1, 0, 2, 3).reshape(hkv, -1, D), TK[tl][:, :n - m]], 1))
            rows_v.append(np.concatenate([Vd[t].transpose(1, 0, 2, 3).reshape(hkv, -1, D), TV[tl][:, :n - m]], 1))
    Q = np.array(q.astype(mx.float32)).astype(np.float64)[:, :, 0]
    worst = 0.0
    got = np.array(out.astype(mx.float32))[:, :, 0]
    for b in range(B):
        for hq in range(hkv * rep):
            kk, vv = rows_k[b][hq // rep].astype(np.float64), rows_v[b][hq // rep].astype(np.float64)
            s = kk @ Q[b, hq] * scale
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ vv
            worst = max(worst, float(np.abs(ref - got[b, hq]).max()))
    return worst


def kernel_checks(modes=("none", "q8", "q4"), dtypes=("float32", "bfloat16", "float16"),
                  chunks=(None, 0, 48, 100), launch: dict | None = None) -> bool:
    ok = True
    for mode in modes:
        for dtype in (getattr(mx, d) for d in dtypes):
            tol = 2e-4 if dtype == mx.float32 else 2e-2
            for D, rep, P, group in ((64, 4, 16, 64), (128, 4, 64, 64), (64, 1, 64, 32), (128, 2, 16, 128),
                                     (96, 3, 16, 32)):
                for chunk in chunks:  # tokens per split (None: default, 0: unsplit)
                    if dtype != mx.float32 and chunk not in (None, 48):
                        continue
                    try:
                        err = kernel_case(mode, dtype, D, rep, P, chunk, group=group, launch=launch)
                    except Exception as e:  # report and go on
                        print(f"FAIL kernel {mode} {dtype} D={D} rep={rep} P={P} chunk={chunk}: {e}", flush=True)
                        ok = False
                        continue
                    good = err <= tol
                    ok &= good
                    print(f"{'ok  ' if good else 'FAIL'} kernel kv={mode:4s} {str(dtype):18s} D={D:3d} rep={rep} "
                          f"P={P:2d} g={group:3d} chunk={chunk} max|dout|={err:.2e}", flush=True)
    return ok


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    """"label:chunk=256,unsplit=1024;label2:" -> [(label, {chunk: 256, unsplit: 1024}), (label2, {})]:
    CudaLaunch settings (engine.options.cuda) per label."""
    out = []
    for item in filter(None, spec.split(";")):
        label, _, kvs = item.partition(":")
        out.append((label, {k: int(v) for k, v in (kv.split("=", 1) for kv in filter(None, kvs.split(",")))}))
    return out


def kernel_bench(contexts=(8192,), batches=(1, 8, 64), geometries=((64, 8, 4), (128, 8, 4)),
                 variants=(("default", {}),), portable: bool = False, n: int = 20,
                 modes=("none", "q8", "q4", "k8v4")) -> dict:
    """Decode attention time of one layer at long context: the fused kernels (none/q8/q4) under
    each variant of the launch settings (CudaLaunch), the
    first variant's outputs as the reference for the others (max |difference|; 0 = same bits), and
    optionally the portable gather + SDPA. Returns {label: {(D, ctx, B, mode): seconds}} (None:
    the variant failed there)."""
    import time

    import numpy as np

    from kvbatch.engine.kv.routes import cuda_kernels as ca

    def timeit(fn):
        mx.eval(fn())
        t = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        return (time.perf_counter() - t) / n

    times: dict = {label: {} for label, _ in variants}
    for D, hkv, rep in geometries:
        for ctx in contexts:
            for B in batches:
                P = 64
                npg = B * (ctx // P)
                kp = mx.random.normal((npg, hkv, P, D)).astype(mx.bfloat16)
                vp = mx.random.normal((npg, hkv, P, D)).astype(mx.bfloat16)
                q = mx.random.normal((B, hkv * rep, 1, D)).astype(mx.bfloat16)
                table = mx.array(np.random.default_rng(0).permutation(npg).reshape(B, -1).astype(np.int32))
                lengths = mx.full((B,), ctx, dtype=mx.int32)
                dense_bytes = 2 * B * ctx * hkv * D * 2
                head = f"bench D={D} Hkv={hkv} rep={rep} ctx={ctx} B={B:3d}"
                if portable:
                    mask = mx.ones((B, 1, 1, ctx), dtype=mx.bool_)
                    t = timeit(lambda: mx.fast.scaled_dot_product_attention(
                        q, kp[table[:, None, :], mx.arange(hkv)[None, :, None]].reshape(B, hkv, ctx, D),
                        vp[table[:, None, :], mx.arange(hkv)[None, :, None]].reshape(B, hkv, ctx, D),
                        scale=0.1, mask=mask))
                    print(f"{head} gather+sdpa {t * 1e6:.0f}us", flush=True)
                calls = {"none": (lambda tune: ca.paged_decode_attention(q, kp, vp, table, lengths, 0.1, tune),
                                  dense_bytes)}
                for name in (m for m in modes if m != "none"):
                    kb, vb = KV_BITS[name]
                    packed = list(mx.quantize(kp, group_size=64, bits=kb)) + \
                        list(mx.quantize(vp, group_size=64, bits=vb))
                    mx.eval(packed)
                    tk, tv = kp[:B], vp[:B]
                    pos = mx.array([ctx - 1] * B, dtype=mx.int32)  # ctx - P sealed, a full tail
                    qbytes = sum(a.nbytes for a in packed) * B * ctx / (npg * P)
                    tails = mx.arange(B).astype(mx.int32)
                    pages = ca.QuantPages(packed, tk, tv, kb, 64, vb)
                    calls[name] = (lambda tune, pages=pages, pos=pos, tails=tails:
                                   ca.paged_decode_attention_quantized(q, pages, tails, table[:, :-1], pos,
                                                                       0.1, tune), qbytes)
                ref = {}
                for label, settings in variants:
                    line = f"{head} {label:>10s}:"
                    tune = CudaLaunch(**settings)
                    for mode, (fn, nbytes) in ((m, c) for m, c in calls.items() if m in modes):
                        try:
                            out = fn(tune)
                            diff = float(mx.abs(out.astype(mx.float32) - ref[mode]).max()) if mode in ref else 0.0
                            ref.setdefault(mode, out.astype(mx.float32))
                            t = timeit(lambda: fn(tune))
                        except Exception as e:  # a variant that fails to compile or run: reported, skipped
                            times[label][(D, ctx, B, mode)] = None
                            line += f" | {mode} FAILED {str(e)[:200]}"
                            continue
                        times[label][(D, ctx, B, mode)] = t
                        line += f" | {mode} {t * 1e6:5.0f}us {nbytes / t / 1e9:5.0f}GB/s d={diff:.1e}"
                    print(line, flush=True)
                kp = vp = calls = ref = None  # freed before the next geometry's pages
                mx.clear_cache()
    return times


def pick_variant(times: dict, checked: dict, batches=(8, 64), modes=("none", "q8", "q4", "k8v4")) -> str | None:
    """The variant with the least total kernel time over `modes` at these batch sizes, among
    those that ran every case and whose checks passed (a label's checks: its own, or those of the
    label before its last '_' part, e.g. raw_mb2_c512 -> raw_mb2)."""
    best, best_t = None, float("inf")
    for label, ts in times.items():
        base = label if label in checked else label.rsplit("_", 1)[0]
        if not checked.get(base, False) or not ts or any(v is None for v in ts.values()):
            continue
        total = sum(v for (D, ctx, B, mode), v in ts.items() if B in batches and mode in modes)
        print(f"pick: {label:>14s} total {total * 1e6:8.0f}us (batches {batches})", flush=True)
        if total < best_t:
            best, best_t = label, total
    return best


def add_args(ap) -> None:
    ap.add_argument("--parts", default="kernels,engine", help="kernels,engine,bench (kernels, bench: CUDA only)")
    ap.add_argument("--kernel-modes", default="none,q8,q4")
    ap.add_argument("--kernel-dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--kernel-chunks", default="default,0,48,100", help="tokens per split; default = CHUNK")
    ap.add_argument("--variants", default="default:",
                    help="bench: launch settings to compare, 'label:chunk=256,warps=4;label2:...' (CudaLaunch)")
    ap.add_argument("--check-variants", default="default:", help="kernels: run the checks under each of these")
    ap.add_argument("--bench-batches", default="1,8,64")
    ap.add_argument("--bench-modes", default="none,q8,q4,k8v4")
    ap.add_argument("--bench-dims", default="64,128",
                    help="head sizes (Hkv 8, GQA 4), or DxHKVxREP (SmolLM2: 64x3x3)")
    ap.add_argument("--bench-contexts", default="8192",
                    help="tokens per row (a short one, e.g. 64, runs unsplit: the per-call floor)")
    ap.add_argument("--portable", action="store_true", help="bench: also the portable gather + SDPA")
    ap.add_argument("--pick-out", default="", help="write the fastest checked variant's settings as config lines")
    ap.add_argument("--pick-batches", default="8,64", help="the batch sizes whose total time picks the variant")
    ap.add_argument("--pick-modes", default="none,q8,q4,k8v4", help="the modes whose total time picks the variant")
    ap.add_argument("--engine-families", default="llama:64,llama:128,qwen3:128", help="engine: family:head size")
    ap.add_argument("--engine-modes", default="none,q8,q4")
    ap.add_argument("--engine-pages", default="16,64")
    ap.add_argument("--engine-rows", type=int, default=8)
    ap.add_argument("--engine-tokens", type=int, default=40, help="engine: forced tokens per row")
    ap.add_argument("--engine-half", action=argparse.BooleanOptionalAction, default=True,
                    help="engine: also bfloat16 and float16 (llama, head size 64, page 16)")


def _kernels(a) -> dict:
    chunks = tuple(None if c == "default" else int(c) for c in a.kernel_chunks.split(","))
    checked = {}
    for label, settings in parse_variants(a.check_variants):
        print(f"kernel checks, variant {label} {settings}", flush=True)
        checked[label] = kernel_checks(tuple(a.kernel_modes.split(",")), tuple(a.kernel_dtypes.split(",")), chunks,
                                       settings)
    return checked


def _geometry(text: str) -> tuple[int, int, int]:
    """"64" -> (64, 8, 4): head size, KV heads, query heads per KV head; "64x3x3" as written."""
    parts = [int(x) for x in text.split("x")]
    return (parts[0], 8, 4) if len(parts) == 1 else (parts[0], parts[1], parts[2])


def _bench(a, checked: dict | None) -> str | None:
    variants = parse_variants(a.variants)
    times = kernel_bench(contexts=tuple(map(int, a.bench_contexts.split(","))),
                         batches=tuple(map(int, a.bench_batches.split(","))),
                         geometries=tuple(_geometry(d) for d in a.bench_dims.split(",")),
                         variants=variants, portable=a.portable, modes=tuple(a.bench_modes.split(",")))
    if not a.pick_out:
        return None
    best = pick_variant(times, checked if checked is not None else {k: True for k, _ in variants},
                        tuple(map(int, a.pick_batches.split(","))), tuple(a.pick_modes.split(",")))
    settings = dict(variants)[best] if best else {}
    print(f"picked: {best} {settings}", flush=True)
    with open(a.pick_out, "w") as f:
        f.write(f"# picked: {best}\n" + "".join(f"engine.options.cuda.{k}={v}\n" for k, v in settings.items()))
    return best


def _engine_checks(a) -> bool:
    ok = True
    tol = 1e-4 if mx.default_device() == mx.cpu else 1e-2
    for family, hd in (f.split(":") for f in a.engine_families.split(",")):
        for mode in a.engine_modes.split(","):
            for page in map(int, a.engine_pages.split(",")):
                ok &= check(family, int(hd), mx.float32, mode, page, tol, rows=a.engine_rows,
                            tokens=a.engine_tokens)
    for dtype in ((mx.bfloat16, mx.float16) if a.engine_half else ()):
        for mode in a.engine_modes.split(","):
            ok &= check("llama", 64, dtype, mode, 16, 0.15, rows=a.engine_rows, tokens=a.engine_tokens)
    if mx.cuda.is_available():  # the split-K path end to end (forced: these contexts are short)
        split16 = EngineOptions(cuda=CudaLaunch(chunk=16, unsplit=16))
        for mode in a.engine_modes.split(","):
            print("engine.options.cuda.chunk=16:", end=" ")
            ok &= check("llama", 128, mx.float32, mode, 16, 1e-2, split16, a.engine_rows, a.engine_tokens)
    return ok


def run(a) -> dict:
    parts = a.parts.split(",")
    print("device:", mx.default_device(), "mlx", mx.__version__, flush=True)
    out: dict = {"ok": True}
    cuda = mx.cuda.is_available()
    if ("kernels" in parts or "bench" in parts) and not cuda:
        print("kernels, bench: skipped (MLX's CUDA backend is not here)", flush=True)
    if "kernels" in parts and cuda:
        out["kernel_checks"] = checked = _kernels(a)
        out["ok"] &= all(checked.values())
    if "bench" in parts and cuda:
        out["picked"] = _bench(a, out.get("kernel_checks") if "kernels" in parts else None)
    if "engine" in parts:
        out["engine_ok"] = _engine_checks(a)
        out["ok"] &= out["engine_ok"]
    out["failed"] = not out["ok"]
    return out
