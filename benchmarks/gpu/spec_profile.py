"""Where the rewrite job's time goes in the engine, with and without n-gram speculation: the issue-41
rewrite prompts (pydoc passages, greedy) through one Engine per side, under cProfile, after an
untimed warm-up of the same engine. Prints each side's engine figures (prefill and decode seconds,
verification passes, acceptance, MLX buffer-cache trims) and the functions with the most own time:
a host-bound side shows Python and graph building there, a device-bound side its waits (tolist,
eval).

    python -m benchmarks gpu.spec_profile --rows 128 --max-tokens 512

--phases replaces cProfile by synchronized timers around the pieces of a pass (the plan, the forward, the
vocab projection and sampling, and per layer the route's K/V write and attention, by the kind of pass), each
piece evaluated and waited for: what each costs on the device, without the overlap of a real run.
--capture-window N keeps the layer-0 inputs of the spec side's N-th verification window and times the
kernel on them afterwards (as captured, decode-style, one decode query a row, pages renumbered contiguous):
the kernel in the job's own shapes, apart from everything around it.
--host-array-probe times a device op right after an array of its output's size was built from host data and
dropped, against the op alone.
--scatter-pages times DenseStore.write of a verification pass's window into pools of these many pages a
layer, idle and with a reader of the pool still in flight: a write that grows with the pool copies it.
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import time
from collections import defaultdict

import mlx.core as mx

from benchmarks import harness as h
from benchmarks.job.speculative import INSTRUCTION, passages
from kvbatch.engine.engine import Engine
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request

SMOKE = ["--model", "tiny", "--rows", "2", "--max-tokens", "4", "--warm", "1", "--top", "3", "--min-chars", "100",
         "--max-chars", "200", "--phases", "--scatter-pages", "8", "--host-array-probe"]


def add_args(ap) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--mode", default="none", help="KV mode (harness.parse_mode), e.g. q8")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--warm", type=int, default=8, help="rows of the untimed warm-up run")
    ap.add_argument("--sides", default="spec,plain")
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--top", type=int, default=25, help="functions listed per side")
    ap.add_argument("--min-chars", type=int, default=1200, help="shortest passage (~300 tokens)")
    ap.add_argument("--max-chars", type=int, default=6000, help="longest passage (~1,500 tokens)")
    ap.add_argument("--phases", action="store_true", help="synchronized timers around a pass's pieces, no cProfile")
    ap.add_argument("--capture-window", type=int, default=0,
                    help="time the kernel on the N-th verification window's layer-0 inputs, as captured from the job")
    ap.add_argument("--host-array-probe", action="store_true",
                    help="a device op's time with and without a freed host-built array of its output's size before it")
    ap.add_argument("--scatter-pages", default="", help="pool sizes (pages a layer) for the write probe")


def _requests(tok, n: int, max_tokens: int, tag: str, chars: tuple[int, int]) -> list[Request]:
    texts = passages(n, 0, *chars)
    return [Request(f"{tag}{i}", tok.encode(INSTRUCTION + t), SamplingParams(max_tokens=max_tokens))
            for i, t in enumerate(texts)]


class _Phases:
    """Synchronized timers around a pass's pieces (installed on the engine's classes for one side)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self._undo: list = []

    def timed(self, name, fn, done=lambda out, args: out):
        def wrapper(*args, **kw):
            mx.eval([x for x in (*args, *kw.values()) if isinstance(x, mx.array)])  # inputs before the clock
            mx.synchronize()
            t = time.perf_counter()
            out = fn(*args, **kw)
            mx.eval(done(out, args))
            mx.synchronize()
            label = name(args) if callable(name) else name
            self.s[label] += time.perf_counter() - t
            self.n[label] += 1
            return out
        return wrapper

    def patch(self, owner, attr: str, name, done=lambda out, args: out) -> None:
        orig = getattr(owner, attr)
        self._undo.append((owner, attr, orig))
        setattr(owner, attr, self.timed(name, orig, done))

    def install(self) -> None:
        import mlx.nn as nn

        from kvbatch.engine import runner as rmod
        from kvbatch.engine.kv.routes import cuda as cmod
        from kvbatch.engine.kv.routes import dense as dmod
        from kvbatch.engine.speculative import verify as vmod

        def kind(args) -> str:
            return type(args[2]).__name__

        nothing = lambda out, args: []  # noqa: E731
        tokens = lambda args: "1" if args[1].shape[1] == 1 else "L"  # noqa: E731  (a decode step's or a window's)
        for lin in (nn.Linear, nn.QuantizedLinear):
            self.patch(lin, "__call__", lambda args: f"linear {tokens(args)}")
        self.patch(nn.RoPE, "__call__", lambda args: f"rope {tokens(args)}")
        self.patch(nn.RMSNorm, "__call__", lambda args: f"rmsnorm {tokens(args)}")
        self.patch(vmod, "forward_hidden", "verify forward", lambda out, args: out[0])
        self.patch(vmod, "sample_batch", "verify sample", lambda out, args: list(out.arrays()))
        self.patch(rmod.Runner, "begin", "begin (plan)", nothing)
        on_gpu = mx.default_device().type == mx.DeviceType.gpu  # the CPU's routes for a dry run
        for route in (cmod.CudaDenseRoute, cmod.CudaQuantRoute) if on_gpu else (dmod.DenseRoute,):
            self.patch(route, "write", lambda args: f"write {kind(args)}",
                       lambda out, args: args[0].store.layer_arrays(args[1]))
            self.patch(route, "attend", lambda args: f"attend {kind(args)}")

    def uninstall(self) -> dict:
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        return {k: {"ms_total": round(v * 1e3, 1), "calls": self.n[k], "ms_each": round(v * 1e3 / self.n[k], 3)}
                for k, v in sorted(self.s.items(), key=lambda kv: -kv[1])}


def _single_ms(fn, before=None) -> float:
    """Milliseconds of one evaluation of fn() (median of 20); before: run ahead of each, off the clock."""
    return round(h.median_ms(fn, n=20, warm=2, before=before), 3)


class _Capture:
    """The layer-0 inputs of the n-th verification window (CudaDenseRoute.attend of a CudaMulti pass)."""

    def __init__(self, n: int) -> None:
        from kvbatch.engine.kv.routes import cuda as cmod

        self.n, self.seen, self.args, self.in_situ_ms = n, 0, None, 0.0
        self.cls, self.orig = cmod.CudaDenseRoute, cmod.CudaDenseRoute.attend
        cap = self

        def attend(route, layer, meta, queries, scale):
            out = cap.orig(route, layer, meta, queries, scale)
            if layer == 0 and isinstance(meta, cmod.CudaMulti):
                cap.seen += 1
                if cap.seen == cap.n:
                    table = meta.step.table
                    mx.eval(out, queries, table, meta.firsts, meta.lengths)
                    cap.args = (queries, route.store.k[0], route.store.v[0], table, meta.firsts, meta.lengths,
                                scale, route.launch)
                    # the same call again, in the job's state (its allocator's cache, its pools), one call
                    # after a sync: the in-situ figure the chained ones after the job are compared with
                    cap.in_situ_ms = _single_ms(lambda: cap.call(cap.args))
            return out
        self.cls.attend = attend  # type: ignore[method-assign]

    @staticmethod
    def call(args) -> mx.array:
        from kvbatch.engine.kv.routes.cuda_kernels import paged_window_attention

        return paged_window_attention(*args)

    @staticmethod
    def host_arrays(B: int, width: int, L: int, kv_heads: int) -> None:
        """Build and drop arrays from host lists of the sizes a verification pass makes (positions, lengths, the
        page table, the head rows of its K/V, its tokens): MLX CUDA allocates these stream-less, in managed
        memory, and their freed buffers join the cache that kernel outputs are then taken from."""
        for n in (B, B, B * width, B * L * kv_heads, B * L, B * L):
            mx.array(list(range(n)), dtype=mx.int32)

    def report(self) -> dict:
        """The captured window's shapes, and the kernel's milliseconds on them (median of 20, chained x10):
        as captured, on the decode-style kernel, one decode query a row, and with each row's pages renumbered
        contiguous (the same pages' count, another order); and one call after a sync, in the job's state at
        the capture, after the job, after the job with MLX's buffer cache emptied before each call, and after
        building and dropping the host arrays a pass makes (window and decode)."""
        from dataclasses import replace

        from kvbatch.engine.kv.routes.cuda_kernels import (paged_decode_attention, paged_window_attention,
                                                           tensor_cores)
        self.cls.attend = self.orig  # type: ignore[method-assign]
        if self.args is None:
            return {"captured": False, "windows_seen": self.seen}
        q, k, v, table, firsts, lengths, scale, launch = self.args
        B, Hq, L, D = q.shape
        rec = {"B": B, "Hq": Hq, "L": L, "D": D, "q_dtype": str(q.dtype), "pool_dtype": str(k.dtype),
               "pool_pages": k.shape[0], "page": k.shape[2], "table_width": table.shape[1],
               "max_keys": int(lengths.max().item()), "mean_keys": float(lengths.astype(mx.float32).mean().item()),
               "tensor_cores": tensor_cores(q.dtype, k.dtype, D, Hq // k.shape[1], k.shape[2], launch.chunk)}

        def ms(fn) -> float:  # chained x10, per call
            return round(h.median_ms(lambda: [fn() for _ in range(10)], n=20, warm=2) / 10, 3)
        contiguous = mx.arange(B * table.shape[1], dtype=mx.int32).reshape(table.shape) % k.shape[0]
        rec["window_ms"] = ms(lambda: paged_window_attention(q, k, v, table, firsts, lengths, scale, launch))
        rec["window_in_situ_single_ms"] = self.in_situ_ms
        rec["window_single_ms"] = _single_ms(lambda: self.call(self.args))
        rec["window_single_fresh_buffers_ms"] = _single_ms(lambda: self.call(self.args), before=mx.clear_cache)
        churn = lambda: self.host_arrays(B, table.shape[1], L, k.shape[1])  # noqa: E731
        rec["window_single_after_host_arrays_ms"] = _single_ms(lambda: self.call(self.args), before=churn)
        rec["decode_single_after_host_arrays_ms"] = _single_ms(
            lambda: paged_decode_attention(q[:, :, :1], k, v, table, firsts + 1, scale, launch), before=churn)
        rec["window_decode_style_ms"] = ms(lambda: paged_window_attention(
            q, k, v, table, firsts, lengths, scale, replace(launch, tensor_cores=False)))
        rec["decode_ms"] = ms(lambda: paged_decode_attention(q[:, :, :1], k, v, table, firsts + 1, scale, launch))
        rec["window_contiguous_pages_ms"] = ms(lambda: paged_window_attention(q, k, v, contiguous, firsts, lengths,
                                                                              scale, launch))
        rec["q_contiguous_window_ms"] = ms(lambda: paged_window_attention(mx.contiguous(q), k, v, table, firsts,
                                                                          lengths, scale, launch))
        return rec


def _host_array_probe(sizes_kib=(16, 256, 6144)) -> list[dict]:
    """One device op (x * 2 over a device array), as it is and right after an array of its output's size was
    built from a host list and dropped (its buffer back in MLX's cache): milliseconds. Where host-built arrays
    get another kind of memory (MLX CUDA: managed) and the cache hands it to the next output of that size, the
    second is slower."""
    out = []
    for kib in sizes_kib:
        n = kib * 1024 // 4
        x = mx.random.normal((n,))
        mx.eval(x)
        host = list(range(n))
        rec = {"kib": kib, "plain_ms": _single_ms(lambda: x * 2),
               "after_host_array_ms": _single_ms(lambda: x * 2, before=lambda: mx.array(host, dtype=mx.float32))}
        print(json.dumps({"host_array": rec}), flush=True)
        out.append(rec)
    return out


def _scatter_probe(pages_list: list[int], window_rows: int = 256 * 5, kv_heads: int = 3, page: int = 16,
                   dim: int = 64) -> list[dict]:
    """DenseStore.write of one window (window_rows tokens) into pools of each size, idle and with a reader in
    flight: milliseconds a write."""
    from kvbatch.engine.kv.store import DenseStore, head_rows

    out = []
    slots = list(range(0, window_rows * 7, 7))  # every 7th slot: the window's tokens spread over the pool
    for pages in pages_list:
        pages = max(pages, -(-(slots[-1] + 1) // page))  # at least the pages the slots name
        st = DenseStore(1, kv_heads, dim, page, mx.bfloat16)
        st.grow(pages)
        mx.eval(st.all_arrays())
        rows = mx.array(head_rows(slots, page, kv_heads), dtype=mx.int32)
        x = mx.ones((window_rows, kv_heads, dim), dtype=mx.bfloat16)
        rec = {"pages": pages, "pool_mb_layer": round(2 * st.k[0].nbytes / 1e6, 1)}
        def write() -> list[mx.array]:
            st.write(0, rows, x, x)
            return st.all_arrays()
        rec["idle_ms"] = _single_ms(write)
        rec["reader_in_flight_ms"] = _single_ms(write, before=lambda: mx.async_eval(st.k[0][:64].sum() +
                                                                                 st.v[0][:64].sum()))
        print(json.dumps({"scatter": rec}), flush=True)
        out.append(rec)
    return out


def run(a) -> dict:
    model, tok, spec = h.load(a.model)
    out: dict = {}
    if a.host_array_probe:
        out["host_array"] = _host_array_probe()
    if a.scatter_pages:
        out["scatter"] = _scatter_probe([int(x) for x in a.scatter_pages.split(",")])
    for side in a.sides.split(","):
        sp = {"method": "ngram", "num_tokens": a.num_tokens} if side == "spec" else None
        eng = Engine(model, tok, spec, h.mode_config(a.mode, speculative=sp, max_batch="auto"))
        chars = (a.min_chars, a.max_chars)
        eng.generate(_requests(tok, a.warm, 32, "w", chars))
        s0 = eng.stats()
        prof = cProfile.Profile()
        trims = [0]
        clear = mx.clear_cache

        def counted() -> None:
            trims[0] += 1
            clear()
        mx.clear_cache = counted  # type: ignore[assignment]  (counts the engine's buffer-cache trims)
        phases = _Phases() if a.phases else None
        if phases:
            phases.install()
        capture = _Capture(a.capture_window) if a.capture_window and side == "spec" else None
        t0 = time.perf_counter()
        if not phases:
            prof.enable()
        res = eng.generate(_requests(tok, a.rows, a.max_tokens, "r", chars))
        if not phases:
            prof.disable()
        wall = time.perf_counter() - t0
        mx.clear_cache = clear  # type: ignore[assignment]
        s1 = eng.stats()
        figs = {k: (s1.get(k) or 0) - (s0.get(k) or 0) for k in ("prefill_s", "decode_s", "spec_passes",
                                                                 "spec_proposed", "spec_accepted")}
        tokens = sum(len(r.tokens) for r in res)
        rec = {"side": side, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "trims": trims[0],
               "max_batch": s1.get("max_batch"), **figs}
        if capture:  # first: its patch wraps the phases' one
            rec["window"] = capture.report()
        if phases:
            rec["phases"] = phases.uninstall()
        print(json.dumps(rec), flush=True)
        if not phases:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.top)
            print(buf.getvalue(), flush=True)
        out[side] = rec
    return out
