"""The CUDA decode kernels' launch settings and source, checked without a GPU.

The kernels themselves only run on MLX CUDA (tests/engine/test_cuda_kernel_write.py and the q8/q4 /
paging tests cover them there). Here: the launch settings (engine.options.cuda) reach each launch,
split ranges depend on a row's own length only, and the kernel text of every variant compiles with
nvcc (as MLX's NVRTC would compile it), so a syntax error in a kernel
fails CI instead of a device call.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.engine.config import CudaLaunch, EngineOptions
from kvbatch.engine.kv.routes import cuda_kernels as ca
from kvbatch.engine.kv.routes import cuda_source as cs

ROOT = Path(__file__).resolve().parents[2]


def test_launch_defaults_and_never_split():
    """The launch settings are engine options (engine.options.cuda.*): their defaults are the
    measured best, 0 chunk tokens never splits, 0 unroll/warps mean the kernel kind's defaults."""
    assert CudaLaunch() == CudaLaunch(chunk=1024, unsplit=1024, unroll=0, warps=0, kernel_writes=True,
                                      tensor_cores=True, quant_tensor_cores=True)
    assert ca.splits_for(100_000, 0, 0)[0] == 1  # 0 = never split
    assert ca.splits_for(100_000, 48, 48) == (-(-100_000 // 48), 48, 48)
    assert ca.splits_for(1000, 256, 1024)[0] == 1  # rows up to `unsplit` tokens are not split


def test_splits_follow_the_longest_row_and_chunk_only():
    # unsplit up to `unsplit` tokens, then ceil(length / chunk) splits of `chunk` tokens
    assert ca.splits_for(1000, 1024, 1024) == (1, 1000, 0)
    assert ca.splits_for(1024, 1024, 1024) == (1, 1024, 0)
    assert ca.splits_for(1025, 1024, 1024) == (2, 1024, 1024)
    assert ca.splits_for(8192, 1024, 1024) == (8, 1024, 1024)
    assert ca.splits_for(8192, 256, 1024) == (32, 256, 1024)
    assert ca.splits_for(0, 256, 1024) == (1, 1, 0)


def test_warps_fit_the_merge_buffers():
    # 8 warps where (head + 2) floats per query head and warp fit in 44 KiB of shared memory
    assert ca.warps_for(128, 4) == 8
    assert ca.warps_for(128, 4, most=4) == 4
    assert ca.warps_for(256, 8) == 4
    assert ca.supports(128, 4, 8, 64) and ca.supports(64, 4, 4, 32)
    assert not ca.supports(100, 4) and not ca.supports(128, 4, 8, 48)


def test_kernel_variants_differ_where_they_should():
    sources = set()
    for q in (False, True):
        for split in (False, True):
            for store in (False, True):
                lean = cs.kernel_source(q, split, store)
                sources.add(lean)
                assert ("pacc[" in lean) == split and ("kn +" in lean) == store
                assert ("qs[r]" in lean) == q  # q8/q4: scales folded into the dot products
    assert len(sources) == 8
    for split in (False, True):  # the tensor cores: each query row stops at its own key count
        for half in (False, True):
            for window, store in ((True, False), (False, False), (False, True)):
                src = cs.mma_source(split, half, window, store)
                assert "lim[h]" in src and ("pacc[" in src) == split and ("firsts[b]" in src) == window
                assert (".f16.f16." in src) == half and (".bf16.bf16." in src) != half
                assert ("kn +" in src or "? kn :" in src) == store
    assert cs.reduce_source(True) != cs.reduce_source()
    quant = set()
    for split in (False, True):  # q8 decode on the tensor cores: fp16 products of codes, tail pages in page type
        for half in (False, True):
            for store in (False, True):
                src = cs.mma_quant_source(split, half, store)
                quant.add(src)
                assert ".f32.f16.f16.f32" in src and (".f32.bf16.bf16.f32" in src) != half
                assert ("pacc[" in src) == split and ("tails[b] * HKV + hk) * P + (len - 1 - n_main)" in src) == store
                # the value biases' sum follows every rescale of the output: sealed tiles' and the tail's
                assert src.count("ab[h][gi] *= corr") == 2 and "+ ab[h][nd / NPG]" in src
    assert len(quant) == 8


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA toolkit) to compile the kernels")
def test_every_kernel_variant_compiles(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks", "gpu.cuda_compile_check", "--out", str(tmp_path / "r.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "nvcc exit 0" in r.stdout
    # every kernel (dense and q8/q4/k8v4 for 4 head geometries x 2 dtypes x split/store, the merges and the
    # q8/q4/k8v4 seals) and for bf16 the tensor-core kernels (window, decode, decode storing: plain, split, merge;
    # q8 decode: plain, split, storing or not)
    assert r.stdout.count(" registers") == 4 * 2 * (4 * 4 + 2 + 3) + 4 * 3 * 3 + 4 * 4


def _cache_as_on_cuda(mode: str, P: int, H: int, kernel_writes: bool, step_reuse: bool = True):
    """A one-layer paged cache whose decode plans are built as on MLX CUDA (fused kernel)."""
    import mlx.core as mx

    from kvbatch.engine.kv.cache import PagedKVCache
    from kvbatch.engine.memory import KVLayout
    from kvbatch.engine.kv.routes.base import Geometry
    from kvbatch.engine.kv.routes.cuda import CudaDenseRoute, CudaQuantRoute

    lay = KVLayout(num_kv_layers=1, num_kv_heads=H, head_dim=64, dtype_bytes=4, mode=mode, group_size=64,
                   page_size=P)
    opts = EngineOptions(route="portable", step_reuse=step_reuse, cuda=CudaLaunch(kernel_writes=kernel_writes))
    cache = PagedKVCache(lay, 1, mx.float32, tail_slots=4, upcast=False, query_heads=H, options=opts)
    geom = Geometry(P, H, 64, H)
    cache.attention = (CudaQuantRoute(cache.store, geom, opts.cuda, opts.step_reuse, False) if mode != "none" else
                       CudaDenseRoute(cache.store, geom, False, opts.cuda, opts.step_reuse))
    return cache


def _rows_at(cache, pos: list[int], reserve: int) -> list:
    """Admitted rows holding pos[i] tokens, with room reserved for `reserve` more."""
    from kvbatch.engine.kv.pages import CacheRow

    rows = []
    for i, p in enumerate(pos):
        r = CacheRow(f"r{i}")
        cache.admit(r)
        cache.reserve(r, p + reserve, 1 << 30)
        r.length = p
        rows.append(r)
    return rows


@pytest.mark.parametrize("kernel_writes", [True, False])
def test_quantized_fused_decode_plan(kernel_writes):
    """The per-step plan of the CUDA q8/q4 decode (built on the host, so checkable here): rows
    at a fresh tail, a full tail (seals this step), a sealed page plus one, two pages plus two."""
    from kvbatch.engine.kv.store import head_rows

    P, H = 16, 2
    cache = _cache_as_on_cuda("q8", P, H, kernel_writes)
    pos = [0, P - 1, P, 2 * P + 2]
    rows = _rows_at(cache, pos, reserve=1)
    t = cache.attention.plan(rows, 1, pos, [1] * len(rows))
    assert t.tails.tolist() == [r.tail for r in rows]
    assert t.positions.tolist() == pos  # the kernels derive each row's sealed and tail counts from it
    assert [x[:n] for x, n in zip(t.table_q.tolist(), [0, 0, 1, 2])] == [r.pages[:n] for r, n in
                                                                        zip(rows, [0, 0, 1, 2])]
    tails = [r.tail for r in rows]
    assert cache.store.k_axis == "token"  # keys per token, as on MLX CUDA: the seal comes as whole pages
    if kernel_writes:  # row 1 fills its tail: the kernel still stores the tokens, then one launch seals it
        assert t.writes is None and t.seal  # (the seal kernel finds the rows and pages from positions and table)
    else:  # this step writes first, then seals
        assert t.writes is not None and not t.seal
        assert t.writes.tail_write.tolist() == head_rows([a * P + p % P for a, p in zip(tails, pos)], P, H)
        src, dst = t.writes.seal_pages
        assert src.tolist() == [tails[1]] and dst.tolist() == [rows[1].pages[0]]
    rest = [rows[0], rows[2], rows[3]]  # no row seals: the kernel stores the token, if it may
    t = cache.attention.plan(rest, 1, [0, P, 2 * P + 2], [1] * 3)
    assert (t.writes is None) == kernel_writes and not t.seal  # None: the kernel stores it; else the step
    assert t.writes is None or (t.writes.seal_pages is None and t.writes.seal_from is None)


@pytest.mark.parametrize("mode", ["none", "q8"])
def test_decode_steps_reuse_tables_only_while_no_page_changes(mode):
    """The CUDA decode carries the last step's device arrays (routes/cuda.py StepArrays: positions, tails;
    PageTables: the table while no page count moves) and derives its counts, and the pages full q8 tails
    seal into, on the device. Every step's arrays must equal a fresh build from the rows, across page
    boundaries (a dense row gains a page, a q8 row seals its tail), after a step that was built and dropped
    (lookahead), and when a row released and given other pages comes back at the counts it had."""
    from kvbatch.engine.kv.pages import CacheRow

    P = 4
    cache = _cache_as_on_cuda(mode, P, 2, kernel_writes=True)

    def expected(rows):
        pos = [r.length for r in rows]
        if mode == "none":
            n = [-(-(p + 1) // P) for p in pos]
            return {"lengths": [p + 1 for p in pos], "table": [r.pages[:k] for r, k in zip(rows, n)]}, n
        n = [p // P for p in pos]
        return {"tails": [r.tail for r in rows], "positions": pos,
                "table_q": [r.pages[:k] for r, k in zip(rows, n)]}, n

    def step(rows):
        for r in rows:
            cache.reserve(r, 1, 1 << 30)
        cache.begin(rows, 1)
        t = cache.plan.meta
        assert cache.plan.offset is t.positions  # the RoPE offsets: the positions the route carries
        assert t.positions.tolist() == [r.length for r in rows]
        want, n = expected(rows)
        tab = "table" if mode == "none" else "table_q"
        for k, v in want.items():
            got = getattr(t, k).tolist()
            if k == tab:
                got = [g[:m] for g, m in zip(got, n)]
            assert got == v, (k, [r.length for r in rows])
        if mode == "q8":  # a step seals where a row's tail fills (into the row's page at its position)
            fills = any(r.length % P == P - 1 for r in rows)
            assert t.seal == fills
            seals.append(fills)
        cache.end()
        return getattr(t, tab)

    seals: list[bool] = []
    rows = _rows_at(cache, [0, P, 2 * P], reserve=0)  # in step: they cross page boundaries together
    tables = [step(rows) for _ in range(9)]
    assert mode == "none" or any(seals)
    same = [a is b for a, b in zip(tables, tables[1:])]
    assert any(same) and not all(same)  # reused between page changes, rebuilt at them
    for r in rows:
        cache.reserve(r, 1, 1 << 30)
    cache.begin(rows, 1)  # built, then dropped: the next step is built for the same tokens
    cache.plan = None
    step(rows)
    # row 0 released, another row takes its pages, row 0 comes back on other pages at the
    # length it had: its counts move by one as if nothing happened
    length = rows[0].length
    cache.release(rows[0])
    other = CacheRow("other")
    cache.admit(other)
    cache.reserve(other, 2 * P, 1 << 30)
    cache.admit(rows[0])
    cache.reserve(rows[0], length, 1 << 30)
    rows[0].length = length
    assert rows[0].pages != other.pages
    step(rows)
    # engine.options.step_reuse=false: built from the host every step
    cache = _cache_as_on_cuda(mode, P, 2, kernel_writes=True, step_reuse=False)
    rows = _rows_at(cache, [0, P, 2 * P], reserve=0)
    tables = [step(rows) for _ in range(5)]
    assert not any(a is b for a, b in zip(tables, tables[1:]))


def _recording_kernels(monkeypatch) -> list:
    """Replace the CUDA kernels by a stand-in that records each launch (key, inputs, output
    shapes, grid, templates) and returns zeros: the launch plumbing runs on any backend."""
    import mlx.core as mx

    calls = []

    class Rec:
        def __init__(self, key):
            self.key = key

        def __call__(self, inputs, output_shapes, output_dtypes, **kw):
            calls.append(dict(key=self.key, inputs=inputs, shapes=output_shapes, **kw))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        def bind(self, inputs, template, output_dtypes):  # as KernelBuild.bind: the launcher holds the template
            return lambda **kw: self(template=template, **kw)

    monkeypatch.setattr(ca, "_kernel", lambda *key: Rec(key))
    monkeypatch.setattr(ca, "_launches", {})  # no stand-in left cached for a later (GPU) test
    monkeypatch.setattr(ca, "_seals", {})
    return calls


def test_launch_parameters_follow_each_call(monkeypatch):
    """The launch plumbing (cuda_kernels._launch, its per-step-shape cache) with a recording
    stand-in for the kernels: each call gets the grid, templates, split metadata and outputs of
    its own shapes, also when an earlier call with other shapes is cached; the merge kernel reads
    the split kernel's partials and the row lengths."""
    import mlx.core as mx

    calls = _recording_kernels(monkeypatch)
    tune = CudaLaunch(chunk=64, unsplit=64, unroll=2, warps=0)
    B, Hkv, rep, D, P = 2, 2, 2, 64, 16
    q = mx.zeros((B, Hkv * rep, 1, D))
    pool = mx.zeros((12, Hkv, P, D))
    for maxp, lens in ((3, [40, 48]), (6, [70, 96]), (3, [33, 48])):  # unsplit, split (2 ranges), unsplit again
        calls.clear()
        lengths = mx.array(lens, dtype=mx.int32)
        out = ca.paged_decode_attention(q, pool, pool, mx.zeros((B, maxp), dtype=mx.int32), lengths, 0.5, tune)
        assert out.shape == (B, Hkv * rep, 1, D)
        nw = ca.warps_for(D, rep)
        ns = 1 if maxp * P <= 64 else -(-maxp * P // 64)
        first = calls[0]
        assert first["key"] == ("dense", ns > 1, False)
        assert first["grid"] == (B * Hkv * ns * 32 * nw, 1, 1) and first["threadgroup"] == (32 * nw, 1, 1)
        assert dict(first["template"])["P"] == P and dict(first["template"])["REP"] == rep
        meta = first["inputs"][5]
        assert meta.tolist()[:2] == [maxp, ns] and first["inputs"][6].tolist() == [0.5]
        if ns == 1:
            assert len(calls) == 1 and first["shapes"] == [(B, Hkv * rep, D)]
        else:
            n = B * Hkv * ns * rep
            assert first["shapes"] == [(n,), (n,), (n * D,)]
            red = calls[1]
            assert red["key"] == ("reduce", False) and red["grid"] == (B * Hkv * 128, 1, 1)
            assert red["inputs"][3] is meta and red["inputs"][4].tolist() == lens


def test_window_launch_follows_its_positions(monkeypatch):
    """A verification window's launch: bf16/fp16 windows on the tensor cores in blocks of as many
    positions as keep heads x positions within 16 rows, output (B, Hq, L, D), a split window merged per
    (row, KV head, positions) with the rows' key counts; float32 (or tensor_cores=false) through the
    decode kernel, one (row, position) a row, each position's own key count."""
    import mlx.core as mx

    calls = _recording_kernels(monkeypatch)
    B, Hkv, rep, D, P, L = 3, 2, 3, 64, 16, 5
    firsts, lengths = mx.array([4, 30, 90], dtype=mx.int32), mx.array([9, 33, 95], dtype=mx.int32)
    for maxp in (2, 7):  # unsplit, split (64-token ranges)
        calls.clear()
        q = mx.zeros((B, Hkv * rep, L, D), dtype=mx.bfloat16)
        pool = mx.zeros((40, Hkv, P, D), dtype=mx.bfloat16)
        out = ca.paged_window_attention(q, pool, pool, mx.zeros((B, maxp), dtype=mx.int32), firsts, lengths, 0.5,
                                        CudaLaunch(chunk=64, unsplit=64))
        assert out.shape == (B, Hkv * rep, L, D)
        qc = 16 // rep
        nqc, ns = -(-L // qc), (1 if maxp * P <= 64 else -(-maxp * P // 64))
        t = dict(calls[0]["template"])
        assert calls[0]["key"] == ("mma_window_bf16", ns > 1, False)
        assert t["NW"] == ca.mma_warps(D)
        assert (t["REP"], t["NL"], t["QC"], t["NQC"]) == (rep * qc, L, qc, nqc)
        assert calls[0]["grid"] == (B * Hkv * nqc * ns * 32 * t["NW"], 1, 1)
        assert calls[0]["inputs"][4].tolist() == firsts.tolist() and calls[0]["inputs"][5].tolist() == lengths.tolist()
        if ns == 1:
            assert len(calls) == 1 and calls[0]["shapes"] == [(B, Hkv * rep, L, D)]
        else:
            red = calls[1]
            assert red["key"] == ("reduce_window", False) and red["grid"] == (B * Hkv * nqc * 128, 1, 1)
            assert dict(red["template"])["NQC"] == nqc and red["shapes"] == [(B, Hkv * rep, L, D)]
            assert red["inputs"][4].tolist() == lengths.tolist()
    for dtype, launch in ((mx.float32, CudaLaunch()), (mx.bfloat16, CudaLaunch(tensor_cores=False))):
        calls.clear()
        q = mx.zeros((B, Hkv * rep, L, D), dtype=dtype)
        pool = mx.zeros((40, Hkv, P, D), dtype=dtype)
        out = ca.paged_window_attention(q, pool, pool, mx.zeros((B, 2), dtype=mx.int32), firsts, lengths, 0.5, launch)
        assert out.shape == (B, Hkv * rep, L, D) and [c["key"] for c in calls] == [("dense", False, False)]
        want = [min(f + j + 1, n) for f, n in zip(firsts.tolist(), lengths.tolist()) for j in range(L)]
        assert calls[0]["inputs"][4].tolist() == want  # one (row, position) a row


def test_bf16_decode_runs_on_the_tensor_cores_like_a_window(monkeypatch):
    """bf16/fp16 dense decode takes the tensor-core kernel (one position, its queries at len - 1) with the
    warps a window of the same head size takes, storing the step's K/V when asked; float32, a page size
    not a multiple of 16 or tensor_cores=false keep the decode-style kernel."""
    import mlx.core as mx

    calls = _recording_kernels(monkeypatch)
    B, Hkv, rep, D, P = 2, 2, 4, 64, 16
    lengths = mx.array([40, 48], dtype=mx.int32)
    for dtype, page, launch, kind in ((mx.bfloat16, P, CudaLaunch(), "mma_decode_bf16"),
                                      (mx.float16, P, CudaLaunch(), "mma_decode_f16"),
                                      (mx.float32, P, CudaLaunch(), "dense"),
                                      (mx.bfloat16, 8, CudaLaunch(), "dense"),
                                      (mx.bfloat16, P, CudaLaunch(tensor_cores=False), "dense")):
        for new_kv in (None, (mx.zeros((B, Hkv, 1, D), dtype=dtype),) * 2):
            calls.clear()
            q = mx.zeros((B, Hkv * rep, 1, D), dtype=dtype)
            pool = mx.zeros((12, Hkv, page, D), dtype=dtype)
            out = ca.paged_decode_attention(q, pool, pool, mx.zeros((B, 3), dtype=mx.int32), lengths, 0.5, launch,
                                            new_kv=new_kv)
            assert out.shape == (B, Hkv * rep, 1, D)
            assert calls[0]["key"] == (kind, False, new_kv is not None)
            assert len(calls[0]["inputs"]) == 7 + 2 * (new_kv is not None)  # q, k, v, table, lengths, meta, scale
            if kind != "dense":
                t = dict(calls[0]["template"])
                assert (t["NL"], t["QC"], t["NQC"], t["REP"], t["NW"]) == (1, 1, 1, rep, ca.mma_warps(D))
                assert calls[0]["grid"] == (B * Hkv * 32 * t["NW"], 1, 1) and calls[0]["shapes"] == [(B, Hkv * rep, D)]


def test_q8_decode_runs_on_the_tensor_cores_where_dense_decode_does(monkeypatch):
    """With cuda.quant_tensor_cores, q8 decode of bf16/fp16 tails takes the tensor-core q8 kernel (its merge reads
    the rows' positions), with a decode's launch (one position, the warps of the head size), storing the step's
    K/V when asked, by default; q4, k8v4, groups of 16, float32, a page size not a multiple of 16 and
    quant_tensor_cores=false keep the decode-style kernel."""
    import mlx.core as mx

    calls = _recording_kernels(monkeypatch)
    B, Hkv, rep, D, P = 2, 2, 4, 64, 16
    pos = mx.array([36, 1048], dtype=mx.int32)  # 32 + 5 and 1,040 + 9 keys with 16-token pages
    on = CudaLaunch()
    cases = ((mx.bfloat16, P, 8, 8, 64, on, "mma_quant_bf16"),
             (mx.float16, P, 8, 8, 32, on, "mma_quant_f16"),
             (mx.bfloat16, P, 4, 4, 64, on, "quant"),
             (mx.bfloat16, P, 8, 4, 64, on, "quant"),
             (mx.bfloat16, P, 8, 8, 16, on, "quant"),
             (mx.float32, P, 8, 8, 64, on, "quant"),
             (mx.bfloat16, 8, 8, 8, 64, on, "quant"),
             (mx.bfloat16, P, 8, 8, 64, CudaLaunch(quant_tensor_cores=False), "quant"))
    for dtype, page, kbits, vbits, group, launch, kind in cases:
        packed = ([mx.zeros((12, Hkv, page, D * kbits // 32), dtype=mx.uint32)]
                  + [mx.zeros((12, Hkv, page, D // group), dtype=dtype)] * 2
                  + [mx.zeros((12, Hkv, page, D * vbits // 32), dtype=mx.uint32)]
                  + [mx.zeros((12, Hkv, page, D // group), dtype=dtype)] * 2)
        tail = mx.zeros((B, Hkv, page, D), dtype=dtype)
        for new_kv in (None, (mx.zeros((B, Hkv, 1, D), dtype=dtype),) * 2):
            calls.clear()
            q = mx.zeros((B, Hkv * rep, 1, D), dtype=dtype)
            out = ca.paged_decode_attention_quantized(q, ca.QuantPages(packed, tail, tail, kbits, group, vbits),
                                                      mx.array([1, 0], dtype=mx.int32),
                                                      mx.zeros((B, 1100 // page), dtype=mx.int32), pos, 0.5, launch,
                                                      new_kv)
            assert out.shape == (B, Hkv * rep, 1, D)
            assert calls[0]["key"] == (kind, True, new_kv is not None)  # the longest row splits (over 1,024 keys)
            assert len(calls[0]["inputs"]) == 14 + 2 * (new_kv is not None)
            t = dict(calls[0]["template"])
            if kind.startswith("mma"):
                assert (t["NL"], t["QC"], t["NQC"], t["REP"], t["NW"]) == (1, 1, 1, rep, ca.mma_warps(D))
                assert (t["KBITS"], t["VBITS"], t["GS"]) == (8, 8, group)
            assert dict(calls[1]["template"])["QL"] == 1  # the merge reads positions: keys are one more
            assert calls[1]["inputs"][4] is calls[0]["inputs"][11]  # the positions the decode kernel read


def test_launch_settings_per_kernel_kind(monkeypatch):
    """Unset (0) unroll and warps take the kernel kind's defaults (dense 8 warps x 2 tokens,
    q8/q4 4 x 4); set ones apply to both kinds."""
    import mlx.core as mx

    calls = _recording_kernels(monkeypatch)
    B, Hkv, rep, D, P, maxp = 2, 2, 2, 64, 16, 3
    q = mx.zeros((B, Hkv * rep, 1, D))
    pool = mx.zeros((12, Hkv, P, D))
    table = mx.zeros((B, maxp), dtype=mx.int32)
    packed = [mx.zeros((12, Hkv, P, D // 4), dtype=mx.uint32)] + [mx.zeros((12, Hkv, P, D // 32))] * 2
    packed = packed * 2
    pos = mx.array([36, 24], dtype=mx.int32)
    for unroll, warps in ((0, 0), (2, 8), (4, 4)):
        tune = CudaLaunch(chunk=0, unsplit=0, unroll=unroll, warps=warps)
        calls.clear()
        ca.paged_decode_attention(q, pool, pool, table, mx.array([40, 48], dtype=mx.int32), 0.5, tune)
        ca.paged_decode_attention_quantized(q, ca.QuantPages(packed, pool, pool, 8, 32),
                                            mx.array([0, 1], dtype=mx.int32), table, pos, 0.5, tune)
        got = [(c["key"][0], dict(c["template"])["NW"], dict(c["template"])["U"], c["threadgroup"][0])
               for c in calls]
        want_d = (warps or 8, unroll or 2)
        want_q = (warps or 4, unroll or 4)
        assert got == [("dense", *want_d, 32 * want_d[0]), ("quant", *want_q, 32 * want_q[0])]


def test_page_tables_built_from_the_step_before_match_whole_builds():
    """PageTables (decode steps' and verification windows' tables, only changed rows written again) gives
    page_table's entries at every step: rows starting pages at different steps, the table widening and
    narrowing, rows leaving and joining, a row preempted and admitted again in the same place with other
    pages, a count that drops (a rollback), pages freed by a rollback and others taken at the same count."""
    import random

    import mlx.core as mx

    from kvbatch.engine.kv.pages import CacheRow
    from kvbatch.engine.kv.routes.common import PageTables, page_table

    rnd = random.Random(3)
    next_page = [0]

    def new_row(i: int) -> CacheRow:
        r = CacheRow(f"r{i}", admissions=1)
        grow(r, rnd.randint(0, 3))
        return r

    def grow(r: CacheRow, k: int) -> None:
        r.pages += list(range(next_page[0], next_page[0] + k))
        next_page[0] += k

    rows = [new_row(i) for i in range(12)]
    tables = PageTables()
    for step in range(300):
        for r in rows:
            if rnd.random() < 0.2:
                grow(r, 1)
        event = rnd.random()
        if event < 0.05:  # a row ends, another joins at the end
            rows.pop(rnd.randrange(len(rows)))
            rows.append(new_row(100 + step))
        elif event < 0.08:  # preempted and admitted again in its place: new pages, maybe as many
            r = rnd.choice(rows)
            n = len(r.pages)
            r.pages, r.admissions = [], r.admissions + 1
            grow(r, n)
        elif event < 0.10:  # a rollback: the count drops
            r = rnd.choice(rows)
            del r.pages[max(len(r.pages) - 1, 0):]
            r.cuts += 1
        elif event < 0.14:  # a window's pages freed by its rollback, others reserved by the next: the same count
            r = rnd.choice(rows)
            k = min(len(r.pages), rnd.randint(1, 3))
            del r.pages[len(r.pages) - k:]
            r.cuts += 1
            grow(r, k)
        counts = [len(r.pages) if rnd.random() < 0.9 else max(len(r.pages) - 1, 0) for r in rows]
        got = tables.table(rows, counts)
        want = page_table(rows, counts)
        assert mx.array_equal(got, want).item(), (step, got.tolist(), want.tolist())
    assert next_page[0] > 100
